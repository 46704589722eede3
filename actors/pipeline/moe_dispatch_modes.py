"""How a stage's MoE layers reach its expert shards and how its experts are balanced, named once
for ParallelConfig, the serve settings and the cluster benchmark (no heavy imports: `k3ray serve
--help` reads it).

router: through the stage's MoERouter actor; direct: the stage's own actor calls to the shards;
compiled: a Ray Compiled Graph the stage compiles over its shards (see pipeline/moe_dispatch.py)."""

from __future__ import annotations

from typing import Literal, get_args

MoEDispatchMode = Literal["router", "direct", "compiled"]
MOE_DISPATCH_MODES: tuple[str, ...] = get_args(MoEDispatchMode)
DEFAULT_MOE_DISPATCH: MoEDispatchMode = "direct"  # one actor call in series per layer fewer than "router"
# expert balancing (pipeline/expert_placement.py), with expert parallelism: replica slots per shard (each MoE
# layer of the stage) for the hottest experts, re-placed every so many steps (0: never)
DEFAULT_REDUNDANT_EXPERTS = 1
DEFAULT_REBALANCE_STEPS = 64
