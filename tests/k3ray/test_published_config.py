"""A checkpoint in the published layout that k3ray did not write: config.json with only the keys the
published field list requires (no token ids, no shared experts, a vocabulary under 512) and no
tokenizer files, loaded with the published class's defaults and a tokenizer named elsewhere."""

import json

import pytest
import torch

from k3ray.api import K3
from k3ray.config import ModelConfig
from k3ray.engine import LLM
from k3ray.models.init import build_model
from k3ray.sampling_params import SamplingParams
from k3ray.tokenizer import ByteTokenizer
from k3ray.weights import save_checkpoint

VOCAB = 300
PROMPT_IDS = [104, 195, 169, 108, 108, 111, 32, 257]  # "héllo [EOS]"
REQUIRED_ONLY = {  # bare kimi_linear text config: the published keys without a class default
    "model_type": "kimi_linear",
    "hidden_size": 64, "num_hidden_layers": 4, "vocab_size": VOCAB, "intermediate_size": 128,
    "attn_res_block_size": 2, "num_attention_heads": 2, "q_lora_rank": 24, "kv_lora_rank": 16,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "num_experts": 4,
    "num_experts_per_token": 2, "moe_intermediate_size": 32, "routed_expert_hidden_size": 32,
    "linear_attn_config": {"num_heads": 2, "head_dim": 32, "gate_lower_bound": -5.0,
                           "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
}


def test_absent_keys_take_the_published_class_defaults():
    config = ModelConfig.from_hf(REQUIRED_ONLY)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 0)
    assert (config.num_shared_experts, config.first_k_dense_replace, config.rms_norm_eps) == (0, 0, 1e-6)
    assert (config.vocab_size, config.expert_format, config.layer_types) == (VOCAB, "bf16", ("kda",) * 3 + ("mla",))


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """(checkpoint dir without tokenizer files, a tokenizer dir elsewhere, logits of PROMPT with the
    full config.json k3ray writes)."""
    checkpoint, tokenizer_dir = tmp_path_factory.mktemp("published"), tmp_path_factory.mktemp("tokenizer")
    save_checkpoint(build_model(ModelConfig.from_hf(REQUIRED_ONLY), torch.float32, seed=3), checkpoint)
    ByteTokenizer(VOCAB).save_pretrained(tokenizer_dir)
    full_config_logits = K3.load(str(checkpoint), device="cpu").logits(PROMPT_IDS)
    (checkpoint / "config.json").write_text(json.dumps(REQUIRED_ONLY))
    return checkpoint, tokenizer_dir, full_config_logits


def test_k3_load_with_a_tokenizer_elsewhere(published):
    checkpoint, tokenizer_dir, full_config_logits = published
    assert K3.load(str(checkpoint), device="cpu").tokenizer is None
    k3 = K3.load(str(checkpoint), device="cpu", tokenizer=str(tokenizer_dir))
    assert k3.tokenizer.vocab_size == VOCAB and k3.vocab_size == VOCAB
    assert k3.tokenizer.encode("héllo [EOS]", allow_special=True) == PROMPT_IDS
    torch.testing.assert_close(k3.logits(PROMPT_IDS), full_config_logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="no tokenizer in"):
        K3.load(str(checkpoint), device="cpu", tokenizer=str(checkpoint))


def test_llm_with_a_tokenizer_elsewhere(published):
    checkpoint, tokenizer_dir, _ = published
    llm = LLM(str(checkpoint), tokenizer=str(tokenizer_dir), device="cpu", max_model_len=64,
              cache_memory_bytes=8 << 20)
    out = llm.generate(["The Ray"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
