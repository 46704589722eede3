"""The command-line flags that pick where the model runs (torch-free, so `--help` stays fast)."""

from __future__ import annotations

import argparse

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")  # "cuda:N": any CUDA device index
DTYPE_CHOICES = ("float32", "bfloat16")


def add_device_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--device`: resolved by k3ray.device.resolve_device when the command runs."""
    parser.add_argument("--device", default="auto", metavar="{" + ",".join(DEVICE_CHOICES) + "}",
                        help="where the model, its caches and sampling run (auto: CUDA when available)")


def add_enforce_eager_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--enforce-eager`: EngineConfig.enforce_eager."""
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs: decode steps run eagerly too (the CPU always does)")


def add_dtype_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: str = "float32") -> None:
    """`--dtype`: the torch dtype name of the weights and activations (getattr(torch, args.dtype))."""
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=default, help="weights and activations")
