"""`k3ray info`, `k3ray generate` and the Python entry point on the published and custom shapes."""

import json

import pytest
import torch

from k3ray.api import K3
from k3ray.cli import main as cli_main
from k3ray.config import ModelConfig, k3_config, k3_tiny_config
from k3ray.info import sequence_memory, summarize
from k3ray.models.init import build_model
from k3ray.tokenizer import ByteTokenizer
from k3ray.weights import save_checkpoint


def test_k3_parameter_counts_match_the_published_totals():
    s = summarize(k3_config())
    assert round(s.total / 1e12, 4) == 2.7795  # docs/k3-architecture.md §1.3: 2.7795 T text parameters
    assert 103.5e9 < s.active < 104.5e9  # "about 104 B active", lm_head included
    assert round(s.per_layer["kda"] / 1e6, 1) == 443.7
    assert round(s.per_layer["mla"] / 1e6, 1) == 232.2
    assert round(s.per_layer["routed_experts"] / 1e9, 1) == 29.6
    assert s.params["embedding"] == s.params["lm_head"] == 163840 * 7168  # untied
    assert s.params["shared_experts"] == 92 * 3 * 7168 * 6144


def test_k3_sequence_memory():
    m = sequence_memory(k3_config(), 1_048_576)
    assert m.kda_state_bytes == 69 * 96 * 128 * 128 * 4  # 414 MiB, constant in context length
    assert m.kda_state_bytes / 2**20 == pytest.approx(414, abs=0.5)
    assert m.mla_bytes_per_token == 27_648  # 24 layers x 576 values x 2 bytes
    assert m.mla_bytes == 27_648 * 1_048_576


def test_info_cli_json(capsys):
    assert cli_main(["info", "--model", "k3", "--context-len", "1m", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["total_params"] == summarize(k3_config()).total
    assert report["layers"] == {"total": 93, "kda": 69, "mla": 24}
    assert report["sequence_memory"]["mla_bytes_per_token"] == 27_648


def custom_config() -> ModelConfig:
    """K3-shaped but not a preset: other widths, 6 layers, block size 2, bf16 experts."""
    return k3_tiny_config().replace(
        name="custom", hidden_size=48, num_layers=6, layer_types=("kda", "mla", "kda", "kda", "mla", "mla"),
        attn_res_block_size=2, kda_num_heads=3, kda_head_dim=16, kda_a_log_size=16, mla_num_heads=3,
        q_lora_rank=20, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_experts=6,
        num_experts_per_token=3, num_shared_experts=1, moe_intermediate_size=24, routed_expert_hidden_size=20,
        expert_format="bf16", intermediate_size=40,
    )


def test_entry_point_loads_any_k3_shaped_checkpoint(tmp_path):
    model = build_model(custom_config(), torch.bfloat16, seed=4)
    save_checkpoint(model, tmp_path)
    ByteTokenizer(512).save_pretrained(tmp_path)
    k3 = K3.load(str(tmp_path))
    assert k3.model.config.num_layers == 6 and k3.model.config.expert_format == "bf16"
    ids = list(range(40, 70))
    ref = build_model(custom_config(), torch.float32, seed=None)
    ref.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in model.state_dict().items()})
    want = K3(ref.eval()).logits(ids)
    assert torch.equal(k3.logits(ids), want)
    assert k3.tokenizer is not None and k3.tokenizer.decode([104, 105]) == "hi"
    assert cli_main(["info", "--model", str(tmp_path)]) == 0


def test_generate_cli_on_the_default_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("K3RAY_CACHE", str(tmp_path))
    assert cli_main(["generate", "--prompt", "Hello", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "5 prompt tokens -> 4 new tokens" in out and out.splitlines()[1].startswith("Hello")
    assert (tmp_path / "k3-tiny-v1" / "config.json").exists() or any(tmp_path.glob("k3-tiny-v*/config.json"))
    assert cli_main(["generate", "--max-tokens", "0"]) == 2
