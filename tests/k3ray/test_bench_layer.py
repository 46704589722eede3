"""`k3ray bench layer` at the tiny widths on CPU: its JSON rows, and layers built as the benchmark says."""

import json

import pytest
import torch

from k3ray.bench.layer import KINDS, bank_size, layer_index, random_layer
from k3ray.cli import main as cli_main
from k3ray.config import k3_config, k3_tiny_config

ROW_KEYS = {"kind", "phase", "batch", "context", "tokens", "ms", "tok_s", "bytes", "roofline_frac"}


def test_bench_layer_writes_a_row_per_kind_and_phase(tmp_path):
    out = tmp_path / "layer.json"
    argv = ["bench", "layer", "--device", "cpu", "--prompt-tokens", "32", "--decode-batch", "1", "3",
            "--context-len", "80", "--repeats", "1", "--json", str(out)]
    assert cli_main(argv) == 0
    result = json.loads(out.read_text())
    assert result["config"]["preset"] == "k3-tiny" and result["machine"]["torch"] == torch.__version__
    rows = result["layers"]
    assert len(rows) == len(KINDS) * 3 and all(set(r) == ROW_KEYS for r in rows)
    assert [(r["kind"], r["phase"], r["batch"]) for r in rows[:3]] == [
        ("kda_dense", "prefill", 1), ("kda_dense", "decode", 1), ("kda_dense", "decode", 3)]
    assert all(r["ms"] > 0 and r["bytes"] > 0 and r["roofline_frac"] is None for r in rows)  # no HBM roofline on CPU
    prefill = [r for r in rows if r["phase"] == "prefill"]
    assert all((r["tokens"], r["context"]) == (32, 32) for r in prefill)
    decode = [r for r in rows if r["phase"] == "decode"]
    assert all(r["context"] == 80 and r["tokens"] == r["batch"] for r in decode)
    # an MLA decode step reads every sequence's whole context: 3 sequences move more than 1
    mla = {r["batch"]: r["bytes"] for r in decode if r["kind"] == "mla_moe"}
    assert mla[3] > mla[1]


def test_the_benchmarked_layers_are_the_kinds_named():
    c = k3_config()
    picks = {k: layer_index(c, k) for k in KINDS}
    assert picks["kda_dense"] == 0
    assert c.layer_types[picks["kda_moe"]] == "kda" and c.is_moe_layer(picks["kda_moe"])
    assert c.layer_types[picks["mla_moe"]] == "mla" and c.is_moe_layer(picks["mla_moe"])
    assert bank_size(c, 0) == 0 and bank_size(c, 1) == 1 and bank_size(c, picks["mla_moe"]) > 1


@pytest.mark.parametrize("kind", ["kda_dense", "mla_moe"])
def test_random_layer_has_finite_outputs_and_mxfp4_experts(kind):
    from k3ray.models.forward_batch import ForwardBatch, ModelCache

    c = k3_tiny_config()
    i = layer_index(c, kind)
    layer = random_layer(c, i, torch.float32, torch.device("cpu"))
    if kind == "mla_moe":
        experts = layer.block_sparse_moe.experts
        assert experts.fmt == "mxfp4" and experts.count == c.num_experts
        assert experts.w1_packed.float().std() > 0  # random bytes, not the zeros it was built with
    cache = ModelCache.allocate(c, 1, 1, 16, layers=range(i, i + 1))
    batch = ForwardBatch(torch.tensor([0, 8]), torch.tensor([8]), torch.tensor([0]), torch.tensor([[0]]), cache)
    x = torch.randn(8, c.hidden_size)
    with torch.no_grad():
        y, _ = layer(x, [torch.randn(8, c.hidden_size) for _ in range(bank_size(c, i))], batch)
    assert y.shape == x.shape and torch.isfinite(y).all()
