"""What a layout asks Ray for and how its tensors travel: `k3ray plan`'s layouts are the actors
`k3ray serve` places (plan JSON -> serve settings -> ParallelConfig -> placement-group bundles),
and the stages' hop and handoff transports follow where Ray put them."""

import json

import pytest

from k3ray.actors.pipeline.executor import actor_bundles, hop_transport
from k3ray.actors.pipeline.config import ParallelConfig
from k3ray.actors.pipeline.stage_records import handoff_transport
from k3ray.actors.serve.config import ServeArgs
from k3ray.cli import main as cli_main
from k3ray.config import preset

BUNDLE_ROLE = {"stage": "stage", "router": "router", "shard": "expert_shard", "vision": "vision"}


@pytest.mark.parametrize("name, flags", [
    ("k3", ["--device-type", "h200", "--context-len", "128k", "--max-num-seqs", "8"]),
    ("k3", ["--device-type", "b200", "--context-len", "32k", "--pipeline", "4", "--expert-parallel", "4"]),
    ("k3-tiny", ["--device-type", "cpu", "--device-memory-gib", "8", "--pipeline", "3", "--expert-parallel", "2"]),
])
def test_plan_layouts_are_the_actors_serve_places(capsys, name, flags):
    assert cli_main(["plan", "--model", name, *flags, "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    args = ServeArgs.model_validate({"parallel": summary["serve_parallel"]})
    assert args.distributed
    bundles, roles = actor_bundles(preset(name), args.parallel_config())
    on_gpus = summary["device"] != "CPU"  # a CPU plan's devices are nodes' memory, not Ray resources
    placed = sorted((BUNDLE_ROLE[role], stage, bundle.get("GPU", 0.0)) for bundle, (role, stage, _) in zip(bundles, roles))
    planned = sorted((a["role"], a["stage"], float(a["devices"]) if on_gpus else 0.0) for a in summary["actors"])
    assert placed == planned
    assert sum(gpus for *_, gpus in placed) == (summary["devices"] if on_gpus else 0)


def test_a_one_device_plan_is_one_undistributed_replica(capsys):
    assert cli_main(["plan", "--model", "k3-tiny", "--device-type", "h200", "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    args = ServeArgs.model_validate({"parallel": summary["serve_parallel"]})
    assert not args.distributed and args.parallel.replica_gpus == summary["devices"] == 1


def _stage(node: str, gpus: list[str], nccl: bool = True) -> dict:
    return {"node_id": node, "gpu_ids": gpus, "device": "cuda:0" if gpus else "cpu", "nccl": nccl}


@pytest.mark.parametrize("stages, transport, expected", [
    ([_stage("a", ["0"]), _stage("a", ["1"])], "auto", "nccl"),  # own GPUs on one node
    ([_stage("a", ["0"]), _stage("b", ["0"])], "auto", "nccl"),  # GPU 0 of two nodes
    ([_stage("a", ["0", "1"]), _stage("a", ["2", "3"])], "auto", "nccl"),
    ([_stage("a", ["0"]), _stage("a", ["0"])], "auto", "host"),  # fractions of one GPU: NCCL cannot pair them
    ([_stage("a", ["0"]), _stage("a", [])], "auto", "host"),  # a CPU stage
    ([_stage("a", []), _stage("a", [])], "auto", "host"),
    ([_stage("a", ["0"]), _stage("a", ["1"], nccl=False)], "auto", "host"),  # no cupy on one of them
    ([_stage("a", ["0"]), _stage("a", ["1"])], "host", "host"),
    ([_stage("a", ["0"])], "auto", "host"),  # one stage: no hops
])
def test_hop_transport_follows_where_the_stages_are(stages, transport, expected):
    assert hop_transport(ParallelConfig(pipeline=len(stages), stage_transport=transport), stages) == expected


def test_stage_transport_is_checked():
    with pytest.raises(ValueError, match="stage_transport"):
        ParallelConfig(stage_transport="nccl-please")
    with pytest.raises(ValueError, match="handoff_transport"):
        ParallelConfig(handoff_transport="nccl")


def _handoff_stage(gpus: list[str], nixl: bool = True) -> dict:
    return {**_stage("a", gpus), "nixl": nixl}


@pytest.mark.parametrize("stages, transport, expected", [
    ([_handoff_stage(["0"]), _handoff_stage(["1"])], "auto", "nixl"),  # every stage on a GPU, nixl at hand
    ([_handoff_stage(["0"]), _handoff_stage(["0"])], "auto", "nixl"),  # fractions of one GPU: NIXL pairs any two
    ([_handoff_stage(["0"])], "auto", "nixl"),  # one stage: still GPU memory to GPU memory
    ([_handoff_stage(["0"]), _handoff_stage([])], "auto", "object-store"),  # a CPU stage
    ([_handoff_stage([]), _handoff_stage([])], "auto", "object-store"),  # CPU stages: the object store is as good
    ([_handoff_stage(["0"]), _handoff_stage(["1"], nixl=False)], "auto", "object-store"),
    ([_handoff_stage(["0"]), _handoff_stage(["1"])], "object-store", "object-store"),
    ([_handoff_stage([]), _handoff_stage([])], "nixl", "nixl"),  # asked for: CPU memory too (CI's path)
])
def test_handoff_transport_follows_where_the_stages_are(stages, transport, expected):
    assert handoff_transport(ParallelConfig(pipeline=len(stages), handoff_transport=transport), stages) == expected


def test_nixl_asked_for_without_nixl_is_refused_naming_the_stage():
    stages = [_handoff_stage([]), _handoff_stage([], nixl=False)]
    with pytest.raises(ValueError, match=r"nixl package on every stage's node; stages \[1\] have none"):
        handoff_transport(ParallelConfig(pipeline=2, handoff_transport="nixl"), stages)


def test_serve_settings_offer_every_handoff_transport():
    from typing import get_args

    from k3ray.actors.pipeline.config import HANDOFF_TRANSPORTS
    from k3ray.actors.serve.config import ParallelSettings

    assert get_args(ParallelSettings.model_fields["handoff_transport"].annotation) == HANDOFF_TRANSPORTS
    args = ServeArgs.model_validate({"model": {"model": "/m"}, "parallel": {"pipeline": 2, "handoff_transport": "nixl"}})
    assert args.parallel_config().handoff_transport == "nixl"
