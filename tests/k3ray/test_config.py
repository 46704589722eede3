import json

import pytest

from k3ray.config import ModelConfig, k3_config, k3_tiny_config, preset


def test_k3_preset_layer_schedule():
    c = k3_config()
    assert c.num_layers == 93
    assert len(c.mla_layer_ids) == 24 and len(c.kda_layer_ids) == 69
    assert c.mla_layer_ids[:3] == (3, 7, 11) and c.mla_layer_ids[-2:] == (91, 92)
    assert c.layer_types[0] == "kda" and not c.is_moe_layer(0) and c.is_moe_layer(1)
    assert c.mla_latent_dim == 576 and c.qk_head_dim == 192
    assert c.shared_intermediate_size == 6144
    assert [i for i in range(93) if c.is_block_boundary(i)] == list(range(0, 93, 12))


def test_tiny_preset_keeps_k3_structure():
    c = k3_tiny_config()
    assert c.layer_types == ("kda", "kda", "kda", "mla", "kda", "kda", "kda", "mla", "mla")
    assert c.first_k_dense_replace == 1 and c.expert_format == "mxfp4" and c.num_shared_experts >= 1
    assert c.attn_res_block_size < c.num_layers


def test_hf_round_trip_nested_and_bare():
    for c in (k3_config(), k3_tiny_config()):
        hf = c.to_hf()
        assert hf["model_type"] == "kimi_k3"
        back = ModelConfig.from_hf(json.loads(json.dumps(hf)), name=c.name)
        assert back == c
        bare = ModelConfig.from_hf(hf["text_config"] | {"quantization_config": hf.get("quantization_config")}, name=c.name)
        assert bare.replace(vision=c.vision) == c


def test_published_one_indexed_lists_convert_once():
    hf = k3_config().to_hf()
    lin = hf["text_config"]["linear_attn_config"]
    assert lin["kda_layers"][:3] == [1, 2, 3] and lin["full_attn_layers"][:2] == [4, 8]
    assert lin["full_attn_layers"][-2:] == [92, 93]
    only_full = dict(lin)
    del only_full["kda_layers"]
    hf["text_config"]["linear_attn_config"] = only_full
    assert ModelConfig.from_hf(hf).layer_types == k3_config().layer_types


def test_bare_kimi_linear_without_quantization_is_bf16_experts():
    text = k3_tiny_config().to_hf()["text_config"]
    c = ModelConfig.from_hf(text)
    assert c.expert_format == "bf16" and c.vision is None


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda t: t.update(num_hidden_layers=0), "num_hidden_layers"),
        (lambda t: t.update(hidden_size=-3), "hidden_size"),
        (lambda t: t["linear_attn_config"].update(kda_layers=[0, 1]), "kda_layers.*out-of-range"),
        (lambda t: t["linear_attn_config"].update(full_attn_layers=[1, 4, 8, 9]), "both"),
        (lambda t: t.update(num_experts_per_token=99), "num_experts_per_token=99"),
        (lambda t: t.update(tie_word_embeddings=True), "tie_word_embeddings"),
        (lambda t: t.update(q_lora_rank=None), "q_lora_rank"),
        (lambda t: t.update(moe_router_activation_func="softmax"), "moe_router_activation_func"),
        (lambda t: t["linear_attn_config"].pop("gate_lower_bound"), "gate_lower_bound"),
        (lambda t: t.pop("kv_lora_rank"), "kv_lora_rank"),
        (lambda t: t.update(eos_token_id=10_000), "eos_token_id=10000"),
    ],
)
def test_invalid_configs_name_the_field(mutate, match):
    hf = k3_tiny_config().to_hf()
    mutate(hf["text_config"])
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(hf)


def test_errors_for_bad_model_type_and_quantization():
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf({"model_type": "llama"})
    hf = k3_tiny_config().to_hf()
    hf["quantization_config"]["format"] = "nvfp4-pack-quantized"
    with pytest.raises(ValueError, match="nvfp4"):
        ModelConfig.from_hf(hf)
    with pytest.raises(ValueError, match="multiple of 32"):
        k3_tiny_config().replace(moe_intermediate_size=48)
    with pytest.raises(ValueError, match="unknown preset"):
        preset("k4")


def test_config_is_frozen():
    with pytest.raises(Exception):
        k3_tiny_config().hidden_size = 3  # type: ignore[misc]
