import pytest

from k3ray.capacity import GIB, PlanRequest, build_plan, plan, problems
from k3ray.cli import main as cli_main
from k3ray.config import k3_config, k3_tiny_config
from k3ray.info import summarize


@pytest.mark.parametrize("cfg", [k3_config, k3_tiny_config])
def test_actor_weights_add_up_to_the_published_checkpoint(cfg):
    c = cfg()
    p = build_plan(PlanRequest(c, "H200", 1024, 1), pipeline=3, expert_parallel=4)
    total = sum(a.weight_bytes for a in p.actors)
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
    assert cli_main(["plan", "--preset", "k3", "--device", "h200", "--context-len", "128k"]) == 0
    assert "expert_shard" in capsys.readouterr().out
    assert cli_main(["plan", "--preset", "k3", "--device", "h200", "--pipeline", "1", "--expert-parallel", "1"]) == 2
    assert "does not fit" in capsys.readouterr().err
