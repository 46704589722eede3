"""`k3ray bench kernels --compare` on CPU at the tiny shapes: every row carries its baseline
fields, the CPU baselines (naive.py, torch) are timed and the CUDA-only ones are skipped with a
reason."""

import argparse

import fla  # noqa: F401 - the fla baselines are reported as needing CUDA, not as missing
import pytest

from k3ray.bench import kernels


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    kernels.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_compare_rows_on_cpu():
    result = kernels.run(_args("--device", "cpu", "--quick", "--model", "k3-tiny", "--compare", "--repeats", "1",
                               "--threads", "1"))
    rows = {row["op"]: row for row in result["ops"]}
    assert {"kda_chunk_prefill", "kda_decode", "conv_prefill", "mla_decode", "mla_prefill",
            "attn_res_rmsnorm", "moe_route", "moe_experts_bf16"} <= set(rows)
    assert all(row["shape"].startswith("k3-tiny") for row in result["ops"])
    for row in result["ops"]:
        timed = {n: b["ms"] for n, b in row["baselines"].items() if "ms" in b}
        assert row["baseline"] == min(timed, key=timed.get)
        assert row["baseline_ms"] == timed[row["baseline"]]
        assert row["speedup_vs_baseline"] == pytest.approx(row["baseline_ms"] / row["ms"])
        assert "roofline_frac" in row
    assert rows["kda_chunk_prefill"]["baselines"]["fla.chunk_kda"] == {
        "skipped": "BaselineUnavailable: fla-core chunk_kda needs CUDA"}
    assert "ms" in rows["kda_chunk_prefill"]["baselines"]["naive_chunk_kda"]
    assert set(rows["mla_decode"]["baselines"]) == {"torch.gather_matmul", "naive_paged_mla_decode"}
    assert "skipped" in rows["moe_experts_bf16"]["baselines"]["torch.bf16_grouped_mm"]
    assert result["config"]["side_by_side"] is True


def test_without_compare_rows_keep_their_keys():
    result = kernels.run(_args("--device", "cpu", "--quick", "--model", "k3-tiny", "--ops", "conv", "--repeats", "1"))
    assert [set(row) for row in result["ops"]] == [
        {"op", "shape", "device", "ms", "tb_s", "tflops", "roofline_frac"}]
    assert result["kda_prefill_vs_naive_chunk"] is None
