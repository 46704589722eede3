"""`k3ray bench cluster --workload skewed`: expert balancing under skewed routing. The tiny K3
with a selection bias that sends every token to expert 0 (half of all routed pairs, on the first
shard), decoded as Ray actors; each repetition runs the static placement (the router's
rebalance with no replica slots) and then the router's balanced placement (--redundant-experts
per shard), in turn, and reports the worst stage's max / mean shard load (pairs counted by the
router, a replicated expert's split evenly over its copies, as the dispatch splits each step's)
and the decode step time of each."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import ray
import torch

from k3ray.actors.pipeline.executor import RayExecutor
from k3ray.actors.pipeline.expert_placement import Placement, max_over_mean
from k3ray.actors.pipeline.config import ParallelConfig
from k3ray.weights import load_model
from k3ray.weights.writer import save_checkpoint

HOT_EXPERT_BIAS = 10.0  # sigmoid scores lie in [0, 1]: expert 0 wins every token's first slot


def skewed_checkpoint(source: str, path: str) -> str:
    """The checkpoint at `source` with expert 0's selection bias raised in every MoE layer, written to `path`."""
    model = load_model(source, torch.float32)
    with torch.no_grad():
        for i in range(model.config.num_layers):
            if model.config.is_moe_layer(i):
                model.model.layers[str(i)].block_sparse_moe.gate.e_score_correction_bias[0] += HOT_EXPERT_BIAS
    save_checkpoint(model, path)
    return path


def run_skewed(args: argparse.Namespace, ckpt: str, spec, decode_args, prefill_args) -> dict:
    if args.expert_parallel < 2:
        raise ValueError("--workload skewed needs --expert-parallel >= 2 (shards to balance)")
    B, prompt = args.decode_batch, 8
    with tempfile.TemporaryDirectory(prefix="k3ray-skewed-") as tmp:
        skewed = skewed_checkpoint(ckpt, tmp)
        # rebalancing only when asked, so each phase runs one known placement
        parallel = ParallelConfig(args.pipeline, args.expert_parallel, moe_dispatch=args.moe_dispatch,
                                  redundant_experts=args.redundant_experts, rebalance_steps=0,
                                  torch_threads=args.threads)
        runner = RayExecutor(skewed, parallel, spec)
        try:
            def decode_ms() -> list[float]:
                runner.step(prefill_args(B, prompt))
                times = []
                for s in range(args.decode_steps):
                    t0 = time.perf_counter()
                    runner.step(decode_args(B, s, prompt))
                    times.append(1000 * (time.perf_counter() - t0))
                return times

            def place(slots: int) -> None:
                """A new placement for the load since the last one, in use by every stage before returning."""
                for g in runner.groups:
                    if g.router is not None:
                        ray.get(g.router.rebalance.remote(slots), timeout=parallel.call_timeout_s)
                deadline = time.monotonic() + parallel.call_timeout_s
                while any(p and (p["pending"] or p["in_use"] != p["version"]) for p in runner.expert_placements()):
                    if time.monotonic() > deadline:
                        raise TimeoutError("the stages did not take up the new placement")
                    runner.step(decode_args(B, 0, prompt))  # stages take placements up between steps

            def phase(slots: int) -> tuple[float, float]:
                """(max / mean shard load of the worst stage, median decode step ms) under a placement."""
                place(slots)
                start = torch.tensor(runner.expert_load())
                times = decode_ms()
                window = torch.tensor(runner.expert_load()) - start  # [stages, E]
                ratios = []
                for g, p, load in zip(runner.groups, runner.expert_placements(), window):
                    if p is not None:
                        ranges = tuple((e0, e1) for e0, e1, _ in g.shards)
                        placement = Placement(ranges, tuple(tuple(r) for r in p["replicas"]))
                        ratios.append(max_over_mean(placement.shard_loads(load)))
                return max(ratios), statistics.median(times)

            decode_ms()  # warm-up (and the first load window)
            before, after = [], []
            for _ in range(args.repeats):  # in turn: the machine is shared and noisy
                before.append(phase(0))
                after.append(phase(args.redundant_experts))
            placements = runner.expert_placements()
        finally:
            runner.shutdown()
    return {
        "expert_load_max_over_mean_before": statistics.median(r for r, _ in before),
        "expert_load_max_over_mean_after": statistics.median(r for r, _ in after),
        "step_ms_before": statistics.median(ms for _, ms in before),
        "step_ms_after": statistics.median(ms for _, ms in after),
        "replicas": [p["replicas"] if p else None for p in placements],
    }
