"""Expert placement with redundant copies (EPLB-style): each shard holds its own expert range plus
replicas of hot experts, and a replicated expert's (row, expert) pairs are spread over its copies.

Pure functions over load counts; the MoERouter actor computes placements (pipeline/moe_router.py), the expert
shards load the replicas (pipeline/expert_shard.py), the dispatch routes pairs by `pair_owners`
(pipeline/moe_dispatch.py). One placement serves every MoE layer of a stage (the router counts load per
expert over the stage's layers)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class Placement:
    """Shard s computes experts [ranges[s][0], ranges[s][1]) and the replicas[s]; version counts
    the router's placements (0: the static ranges)."""

    ranges: tuple[tuple[int, int], ...]
    replicas: tuple[tuple[int, ...], ...]
    version: int = 0

    @classmethod
    def static(cls, ranges) -> Placement:
        ranges = tuple((int(e0), int(e1)) for e0, e1 in ranges)
        return cls(ranges, tuple(() for _ in ranges))

    @property
    def num_experts(self) -> int:
        return self.ranges[-1][1]

    @property
    def replicated(self) -> bool:
        return any(self.replicas)

    def copies(self, expert: int) -> list[int]:
        """The shards holding `expert`, its home shard first."""
        home = next(s for s, (e0, e1) in enumerate(self.ranges) if e0 <= expert < e1)
        return [home] + [s for s, held in enumerate(self.replicas) if expert in held]

    @cached_property
    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(shard of each copy [E, C] (unused columns repeat the home shard), copies per expert [E])."""
        copies = [self.copies(e) for e in range(self.num_experts)]
        width = max(len(c) for c in copies)
        table = torch.tensor([c + [c[0]] * (width - len(c)) for c in copies], dtype=torch.long)
        return table, torch.tensor([len(c) for c in copies], dtype=torch.long)

    def pair_owners(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T, k] -> [T, k] the shard that computes each (row, expert) pair: the i-th pair of an
        expert in the step goes to its copy i mod copies (deterministic, and even within a step)."""
        table, counts = self._tables
        flat = ids.reshape(-1).long()  # [P]
        order = torch.argsort(flat, stable=True)
        per_expert = torch.bincount(flat, minlength=self.num_experts)
        first = torch.cumsum(per_expert, 0) - per_expert  # [E]: where each expert's pairs start in `order`
        rank = torch.empty_like(flat)
        rank[order] = torch.arange(flat.numel()) - first[flat[order]]
        return table[flat, rank % counts[flat]].view(ids.shape)

    @cached_property
    def copy_lists(self) -> list[list[int]]:
        """copies(e) for every expert (the small steps' plain-Python path)."""
        return [self.copies(e) for e in range(self.num_experts)]

    def pair_owners_list(self, flat_ids: list[int]) -> list[int]:
        """pair_owners for a small step's ids as a flat list (a few dozen pairs: Python beats
        a dozen tensor ops per layer)."""
        seen: dict[int, int] = {}
        owners = []
        for e in flat_ids:
            copies = self.copy_lists[e]
            rank = seen.get(e, 0)
            seen[e] = rank + 1
            owners.append(copies[rank % len(copies)])
        return owners

    @cached_property
    def replica_tensors(self) -> list[torch.Tensor]:
        """replicas[s] as [R] long tensors (sent with each shard's rows)."""
        return [torch.tensor(r, dtype=torch.long) for r in self.replicas]

    def shard_loads(self, load: torch.Tensor) -> list[float]:
        """Per-expert load [E] -> each shard's load, an expert's load split evenly over its copies."""
        table, counts = self._tables
        out = torch.zeros(len(self.ranges), dtype=torch.float64)
        share = load.double() / counts  # [E]
        for c in range(table.shape[1]):
            held = counts > c
            out.index_add_(0, table[held, c], share[held])
        return out.tolist()


def max_over_mean(loads: list[float]) -> float:
    """max / mean of the shard loads (1.0 = balanced; 1.0 when nothing ran)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def balance(current: Placement, load: torch.Tensor, slots_per_shard: int) -> Placement:
    """A new placement over current's ranges from per-expert load [E]: greedily give the expert
    with the highest load per copy a replica on the least-loaded shard with a free slot that does
    not hold it, while that moves load from a busier shard to a quieter one."""
    if slots_per_shard < 0:
        raise ValueError(f"slots_per_shard must be >= 0, got {slots_per_shard}")
    S = len(current.ranges)
    replicas: list[list[int]] = [[] for _ in range(S)]
    placement = Placement(current.ranges, tuple(() for _ in range(S)), current.version + 1)
    skipped: set[int] = set()
    while True:
        loads = placement.shard_loads(load)
        _, counts = placement._tables
        per_copy = load.double() / counts  # [E]
        candidates = [e for e in torch.argsort(per_copy, descending=True, stable=True).tolist()
                      if e not in skipped and per_copy[e] > 0]
        if not candidates:
            return placement
        expert = candidates[0]
        holders = placement.copies(expert)
        free = [s for s in range(S) if len(replicas[s]) < slots_per_shard and s not in holders]
        target = min(free, key=lambda s: (loads[s], s)) if free else None
        # the copy takes a share from each holder: worth it only if the target stays below the busiest
        if target is None or loads[target] + load[expert].item() / (len(holders) + 1) >= max(loads[s] for s in holders):
            skipped.add(expert)
            continue
        replicas[target].append(expert)
        placement = Placement(current.ranges, tuple(tuple(sorted(r)) for r in replicas), current.version + 1)
