"""Where each k3ray replica's actors run: its Serve replica and the stages, routers, expert shards
and vision encoder in the replica's placement group, each with its node, device and state.

Read from Ray's GCS tables (actors, nodes; what `ray status` reads), so it needs neither the
dashboard (Ray's state API, `ray list actors`, goes through it) nor a driver: nothing joins the
cluster. A model actor's role comes from its class and its bundle in the placement group, in the
order serve/replica_bundles.py lays them out (the replica's own bundle, then per stage: the stage, its
router and shards; the vision encoder last). Used by `k3ray status`.

    rows = placement_rows(gcs_state("auto"))
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from ray._private.services import canonicalize_bootstrap_address_or_die
from ray._private.state import GlobalState
from ray._raylet import GcsClientOptions, JobID
from ray.core.generated import gcs_pb2

DEPLOYMENT = "K3Server"
REPLICA_CLASS = re.compile(rf"^ServeReplica:(.+):{DEPLOYMENT}$")
MODEL_CLASSES = ("PipelineStage", "MoERouter", "ExpertShard", "VisionEncoder")
_BUNDLE = re.compile(r"^\w+_group_(\d+)_[0-9a-f]+$")
_GPU = re.compile(r"^GPU_group_\d+_[0-9a-f]+$")


@dataclass(frozen=True)
class ActorPlace:
    app: str
    replica: str  # Serve's replica id
    actor: str  # replica, stage S, router S, shard E of stage S, vision encoder
    actor_class: str
    actor_id: str
    node_id: str
    node_address: str
    node_alive: bool
    device: str  # cpu, or the GPUs Ray assigned (ids on the node, a fraction when shared)
    state: str  # Ray's actor state: ALIVE, RESTARTING, PENDING_CREATION, DEAD, ...
    restarts: int
    pid: int

    def as_dict(self) -> dict:
        return asdict(self)


def gcs_state(address: str = "auto") -> GlobalState:
    """Ray's GCS tables of the cluster at `address` ("auto": the one running on this machine)."""
    state = GlobalState()
    state._initialize_global_state(GcsClientOptions.create(
        canonicalize_bootstrap_address_or_die(address), None, allow_cluster_id_nil=True,
        fetch_cluster_id_if_nil=False))
    return state


def actor_table(state: GlobalState, job_id: str | None = None) -> list[gcs_pb2.ActorTableData]:
    """Every actor GCS knows (of the job `job_id`, hex, if given), dead ones included."""
    job = None if job_id is None else JobID.from_hex(job_id)
    return [gcs_pb2.ActorTableData.FromString(raw) for raw in state._connect_and_get_accessor().get_actor_table(job, None)]


def state_name(actor: gcs_pb2.ActorTableData) -> str:
    return gcs_pb2.ActorTableData.ActorState.Name(actor.state)


def placement_rows(state: GlobalState, app: str | None = None) -> list[ActorPlace]:
    """One row per actor of every live K3Server replica (of `app`, or of every app), replicas in
    order of their id, each replica first and its model actors in bundle order."""
    actors = actor_table(state)
    nodes = {n["NodeID"]: n for n in state.node_table()}
    by_group: dict[bytes, list[gcs_pb2.ActorTableData]] = {}
    for actor in actors:
        if actor.placement_group_id:
            by_group.setdefault(actor.placement_group_id, []).append(actor)
    rows = []
    for replica in sorted(actors, key=lambda a: a.name):
        match = REPLICA_CLASS.match(replica.class_name)
        if match is None or replica.state == gcs_pb2.ActorTableData.DEAD or (app and match.group(1) != app):
            continue
        replica_id = replica.name.rsplit("#", 1)[-1]
        members = current_actors(by_group.get(replica.placement_group_id, []))
        for role, actor in [("replica", replica), *model_roles(members)]:
            rows.append(_row(match.group(1), replica_id, role, actor, nodes))
    return rows


def current_actors(members: list[gcs_pb2.ActorTableData]) -> list[tuple[int, gcs_pb2.ActorTableData]]:
    """(bundle, actor) of the model actors in a placement group, one per bundle: the live one where
    a bundle also holds dead ones (a stage the runner started afresh), else the last to die."""
    chosen: dict[int, gcs_pb2.ActorTableData] = {}
    for actor in members:
        bundle = bundle_index(actor)
        if actor.class_name not in MODEL_CLASSES or bundle is None:
            continue
        held = chosen.get(bundle)
        if held is None or _rank(actor) > _rank(held):
            chosen[bundle] = actor
    return sorted(chosen.items(), key=lambda item: item[0])


def _rank(actor: gcs_pb2.ActorTableData) -> tuple[bool, int]:
    return actor.state != gcs_pb2.ActorTableData.DEAD, actor.end_time or actor.start_time


def model_roles(members: list[tuple[int, gcs_pb2.ActorTableData]]) -> list[tuple[str, gcs_pb2.ActorTableData]]:
    """Each model actor's role, named as RayExecutor.actors() names them (without the layer and
    expert ranges), from its class in bundle order."""
    out, stage, shard = [], -1, 0
    for _, actor in members:
        if actor.class_name == "PipelineStage":
            stage, shard = stage + 1, 0
            out.append((f"stage {stage}", actor))
        elif actor.class_name == "MoERouter":
            out.append((f"router {stage}", actor))
        elif actor.class_name == "ExpertShard":
            out.append((f"shard {shard} of stage {stage}", actor))
            shard += 1
        else:
            out.append(("vision encoder", actor))
    return out


def bundle_index(actor: gcs_pb2.ActorTableData) -> int | None:
    """The actor's bundle in its placement group, from the bundle resources it requires."""
    for name in actor.required_resources:
        match = _BUNDLE.match(name)
        if match is not None:
            return int(match.group(1))
    return None


def device(actor: gcs_pb2.ActorTableData) -> str:
    """cpu, or `GPU 0`, `GPU 0,1`, `GPU 0 (0.25)`: the GPU ids on its node Ray assigned the actor."""
    for mapping in actor.resource_mapping:
        if _GPU.match(mapping.name) and mapping.resource_ids:
            ids = ",".join(str(r.index) for r in mapping.resource_ids)
            shares = {round(r.quantity, 4) for r in mapping.resource_ids}
            share = "" if shares == {1.0} else f" ({'/'.join(f'{q:g}' for q in sorted(shares))})"
            return f"GPU {ids}{share}"
    return "cpu"


def _row(app: str, replica: str, role: str, actor: gcs_pb2.ActorTableData, nodes: dict) -> ActorPlace:
    node_id = actor.address.node_id.hex() or actor.node_id.hex()
    node = nodes.get(node_id, {})
    return ActorPlace(app=app, replica=replica, actor=role, actor_class=actor.class_name.rsplit(":", 1)[-1],
                      actor_id=actor.actor_id.hex(), node_id=node_id,
                      node_address=node.get("NodeManagerAddress", actor.address.ip_address),
                      node_alive=bool(node.get("Alive", False)), device=device(actor),
                      state=state_name(actor), restarts=actor.num_restarts,
                      pid=actor.pid)
