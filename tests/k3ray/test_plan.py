import dataclasses
import json

import pytest

from k3ray.capacity import (
    GIB,
    PlanRequest,
    build_plan,
    latent_bytes_per_token,
    layer_kind,
    plan,
    predict_throughput,
    problems,
)
from k3ray.cli import main as cli_main
from k3ray.config import k3_config, k3_tiny_config
from k3ray.info import summarize


@pytest.mark.parametrize("cfg", [k3_config, k3_tiny_config])
def test_actor_weights_add_up_to_the_published_checkpoint(cfg):
    c = cfg()
    p = build_plan(PlanRequest(c, "H200", 1024, 1), pipeline=3, expert_parallel=4)
    total = sum(a.weight_bytes for a in p.actors if a.role != "vision")  # the text model's
    # each stage's routed bytes are split by integer division: at most 1 byte lost per shard
    assert 0 <= summarize(c).weight_bytes - total <= 3 * 4


def test_k3_on_h200_fits_and_every_actor_fits_its_device():
    p = plan(PlanRequest(k3_config(), "H200", 131072, 8))
    assert not problems(p)
    assert all(a.total_bytes <= p.device_bytes for a in p.actors if a.devices)
    stages = [a for a in p.actors if a.role == "stage"]
    assert [s.layers for s in stages][0][0] == 0 and stages[-1].layers[1] == 93
    assert sum(1 for a in p.actors if a.role == "router") == p.pipeline
    # MLA cache: 8 sequences x 131072 tokens x 576 values x 2 bytes on each stage's MLA layers
    mla_layers = len(k3_config().mla_layer_ids)
    assert sum(s.mla_cache_bytes for s in stages) == 8 * 131072 * 576 * 2 * mla_layers


def test_bf16_experts_need_more_devices():
    mx = plan(PlanRequest(k3_config(), "B200", 32768, 4))
    bf = plan(PlanRequest(k3_config(), "B200", 32768, 4, expert_format="bf16"))
    assert bf.num_devices > mx.num_devices


def test_impossible_layouts_are_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"expert shard 0-223 of stage 0 .* GiB usable on one H200"):
        plan(PlanRequest(k3_config(), "H200", 1024, 1, pipeline=2, expert_parallel=4))
    with pytest.raises(ValueError, match="MLA cache"):
        plan(PlanRequest(k3_config(), "H100", 1_048_576, 64, pipeline=1, expert_parallel=896))
    with pytest.raises(ValueError, match="context_len"):
        plan(PlanRequest(k3_config(), "H100", 2_000_000, 1))
    with pytest.raises(ValueError, match="device must be"):
        plan(PlanRequest(k3_config(), "TPU", 1024, 1))
    with pytest.raises(ValueError, match="device-memory-gib"):
        plan(PlanRequest(k3_config(), "CPU", 1024, 1))


def test_tiny_fits_one_cpu_node_and_honours_fixed_sizes():
    p = plan(PlanRequest(k3_tiny_config(), "CPU", 4096, 4, device_memory_gib=8))
    assert (p.pipeline, p.expert_parallel) == (1, 1)
    q = plan(PlanRequest(k3_tiny_config(), "CPU", 4096, 4, pipeline=3, expert_parallel=2, device_memory_gib=8))
    assert (q.pipeline, q.expert_parallel) == (3, 2) and q.num_devices == 3 + 3 * 2
    assert p.device_bytes == int(8 * GIB * 0.9)


def test_plan_cli(capsys):
    assert cli_main(["plan", "--model", "k3", "--device-type", "h200", "--context-len", "128k"]) == 0
    assert "expert_shard" in capsys.readouterr().out
    assert cli_main(["plan", "--model", "k3", "--device-type", "h200", "--pipeline", "1", "--expert-parallel", "1"]) == 2
    assert "does not fit" in capsys.readouterr().err


def _layer_costs(decode_ms: dict[str, dict[int, float]], prefill_ms: dict[str, float], tokens: int = 100,
                 context: int = 4096) -> list[dict]:
    rows = [{"kind": k, "phase": "prefill", "batch": 1, "context": tokens, "tokens": tokens, "ms": ms, "bytes": 10**6}
            for k, ms in prefill_ms.items()]
    rows += [{"kind": k, "phase": "decode", "batch": b, "context": context, "tokens": b, "ms": ms, "bytes": 10**6}
             for k, by_batch in decode_ms.items() for b, ms in by_batch.items()]
    return rows


def _costs_file(path, rows, preset="k3-tiny", device="cpu", gpu=None):
    path.write_text(json.dumps({"layers": rows, "machine": {"gpu": gpu},
                                "config": {"preset": preset, "device": device, "dtype": "bfloat16"}}))
    return str(path)


def test_layer_costs_predict_tokens_per_second_per_device():
    c = k3_tiny_config()  # 9 layers: kda_dense, then MoE layers with MLA at 3 and 7 (every 4th)
    kinds = [layer_kind(c, i) for i in range(c.num_layers)]
    assert kinds[0] == "kda_dense" and kinds.count("mla_moe") == len(c.mla_layer_ids)
    n_kda_moe = kinds.count("kda_moe")
    rows = _layer_costs({"kda_dense": {1: 1.0, 8: 2.0}, "kda_moe": {1: 2.0, 8: 4.0}, "mla_moe": {1: 3.0, 8: 5.0}},
                        {"kda_dense": 10.0, "kda_moe": 20.0, "mla_moe": 30.0})
    p = plan(PlanRequest(c, "CPU", 4096, 4, pipeline=3, expert_parallel=2, device_memory_gib=8))
    pred = predict_throughput(p, rows)
    assert pred.measured_context == pred.context_len == 4096
    # batch 4 lies 3/7 of the way from 1 to 8
    step = sum({"kda_dense": 1 + 3 / 7, "kda_moe": 2 + 6 / 7, "mla_moe": 3 + 6 / 7}[k] for k in kinds)
    assert pred.decode_step_ms == pytest.approx(step)
    assert pred.decode_tok_s == pytest.approx(4 / (step / 1e3))
    assert pred.decode_tok_s_per_device == pytest.approx(pred.decode_tok_s / p.num_devices)
    prefill_s_per_token = (10.0 + 20.0 * n_kda_moe + 30.0 * len(c.mla_layer_ids)) / 1e3 / 100
    assert pred.prefill_tok_s_per_device == pytest.approx(1 / prefill_s_per_token / p.num_devices)
    # beyond the largest batch measured: its time per sequence
    bigger = predict_throughput(plan(PlanRequest(c, "CPU", 4096, 16, pipeline=3, expert_parallel=2,
                                                 device_memory_gib=8)), rows)
    assert bigger.decode_step_ms == pytest.approx(2 * sum({"kda_dense": 2, "kda_moe": 4, "mla_moe": 5}[k] for k in kinds))
    with pytest.raises(ValueError, match="mla_moe"):
        predict_throughput(p, [r for r in rows if r["kind"] != "mla_moe"])


def test_plan_cli_prints_the_prediction_beside_the_memory_plan(tmp_path, capsys):
    costs = tmp_path / "layers.json"
    rows = _layer_costs({k: {1: 1.0, 64: 2.0} for k in ("kda_dense", "kda_moe", "mla_moe")},
                        {k: 5.0 for k in ("kda_dense", "kda_moe", "mla_moe")})
    _costs_file(costs, rows)
    argv = ["plan", "--model", "k3-tiny", "--device-type", "cpu", "--device-memory-gib", "8", "--pipeline", "3",
            "--expert-parallel", "2", "--max-num-seqs", "64", "--context-len", "4096", "--layer-costs", str(costs)]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "expert_shard" in out and "k3ray serve --pipeline 3 --expert-parallel 2 --stage-gpus 0 --shard-gpus 0" in out
    # 9 layers x 2 ms a step of 64 sequences, on 3 stages + 3 x 2 shards
    assert "decode 395.1 tok/s per device (3,555.6 per replica, 18.0 ms a step of 64)" in out
    assert cli_main([*argv, "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["prediction"]["decode_step_ms"] == 18.0 and summary["prediction"]["batch"] == 64
    costs.write_text(json.dumps({"rows": rows}))
    assert cli_main(argv) == 2
    assert "no `layers` list" in capsys.readouterr().err


def test_a_plan_asks_serve_for_its_actors():
    one = plan(PlanRequest(k3_tiny_config(), "H200", 4096, 4))
    assert (one.pipeline, one.expert_parallel, [a.role for a in one.actors]) == (1, 1, ["replica"])
    assert one.serve_parallel() == {"pipeline": 1, "expert_parallel": 1, "replica_gpus": 1.0}
    k3 = plan(PlanRequest(k3_config(), "H200", 131072, 8))
    assert k3.serve_parallel() == {"pipeline": k3.pipeline, "expert_parallel": k3.expert_parallel,
                                   "stage_gpus": 1.0, "shard_gpus": 1.0}
    assert [a.role for a in k3.actors].count("vision") == 1 and k3.actors[-1].devices == 0


def test_expert_shards_make_room_for_the_routers_replicas():
    c = k3_tiny_config()
    req = PlanRequest(c, "CPU", 4096, 4, device_memory_gib=8)
    shards = [a for a in build_plan(req, pipeline=2, expert_parallel=2).actors if a.role == "expert_shard"]
    for a in shards:  # one expert's weights per MoE layer of the stage, beside the shard's own half
        assert a.replica_bytes == a.weight_bytes // (c.num_experts // 2) > 0
        assert a.total_bytes == a.weight_bytes + a.replica_bytes
    none = build_plan(dataclasses.replace(req, redundant_experts=0), pipeline=2, expert_parallel=2)
    assert all(a.replica_bytes == 0 for a in none.actors)
    whole = build_plan(req, pipeline=2, expert_parallel=1)  # no expert parallelism: nothing to balance
    assert all(a.replica_bytes == 0 for a in whole.actors)
    with pytest.raises(ValueError, match="redundant_experts"):
        plan(dataclasses.replace(req, redundant_experts=-1))


def test_layer_costs_of_another_model_or_device_are_refused_unless_labelled_an_extrapolation(tmp_path, capsys):
    """The issue's case: k3-tiny CPU timings at 512 tokens applied to K3 on H200 at 128K."""
    rows = _layer_costs({k: {1: 1.0, 8: 2.0} for k in ("kda_dense", "kda_moe", "mla_moe")},
                        {k: 5.0 for k in ("kda_dense", "kda_moe", "mla_moe")}, context=512)
    costs = _costs_file(tmp_path / "tiny_cpu.json", rows)
    argv = ["plan", "--model", "k3", "--device-type", "H200", "--context-len", "128k", "--layer-costs", costs]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "measured for model k3-tiny, not k3; device cpu, not H200" in err and "--extrapolate" in err
    assert cli_main([*argv, "--extrapolate"]) == 0
    out = capsys.readouterr().out
    assert ("EXTRAPOLATION from costs measured for k3-tiny on cpu" in out
            and "measured at a 512-token context, scaled to 131,072" in out)
    assert cli_main([*argv, "--extrapolate", "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["prediction"]["extrapolated_from"] == "k3-tiny on cpu"
    assert summary["prediction"]["context_len"] == 131072 and summary["prediction"]["measured_context"] == 512
    # the plan's own model on its own device type: no label
    _costs_file(tmp_path / "k3_h200.json", rows, preset="k3", device="cuda:0", gpu="NVIDIA H200")
    assert cli_main([*argv[:-1], str(tmp_path / "k3_h200.json")]) == 0
    out = capsys.readouterr().out
    assert "EXTRAPOLATION" not in out and "predicted from" in out
    _costs_file(tmp_path / "k3_h100.json", rows, preset="k3", device="cuda:0", gpu="NVIDIA H100 80GB HBM3")
    assert cli_main([*argv[:-1], str(tmp_path / "k3_h100.json")]) == 2
    assert "device NVIDIA H100 80GB HBM3, not H200" in capsys.readouterr().err


def test_mla_decode_costs_scale_to_the_plans_context_by_the_latent_bytes_read():
    c = k3_tiny_config()
    kinds = [layer_kind(c, i) for i in range(c.num_layers)]
    rows = _layer_costs({k: {1: 1.0, 8: 2.0} for k in ("kda_dense", "kda_moe", "mla_moe")},
                        {k: 5.0 for k in ("kda_dense", "kda_moe", "mla_moe")}, context=512)
    p = plan(PlanRequest(c, "CPU", 512 + 1000, 8, pipeline=1, expert_parallel=1, device_memory_gib=8))
    pred = predict_throughput(p, rows)
    mla = 2.0 * (10**6 + 8 * 1000 * latent_bytes_per_token(c)) / 10**6  # batch 8 reads 1,000 more tokens each
    assert pred.decode_step_ms == pytest.approx(2.0 * (len(kinds) - kinds.count("mla_moe")) + mla * kinds.count("mla_moe"))
    assert pred.measured_context == 512 and pred.context_len == 1512


@pytest.mark.parametrize("argv", [
    ["--model", "k3-tiny", "--device-type", "cpu", "--device-memory-gib", "8"],
    ["--model", "k3-tiny", "--device-type", "cpu", "--device-memory-gib", "8", "--pipeline", "3", "--expert-parallel", "2"],
    ["--model", "k3", "--device-type", "h200", "--context-len", "128k"],
])
def test_every_actors_memory_columns_add_up_to_its_total(argv, capsys):
    """The activation reserve is a column of its own: the parts sum to total_gib (each rounded to 0.01)."""
    assert cli_main(["plan", *argv, "--format", "json"]) == 0
    actors = json.loads(capsys.readouterr().out)["actors"]
    assert any(a["activations_gib"] > 0 for a in actors)
    for a in actors:
        parts = [v for k, v in a.items() if k.endswith("_gib") and k != "total_gib"]
        assert len(parts) == 5 and abs(sum(parts) - a["total_gib"]) <= 0.005 * 6, a
