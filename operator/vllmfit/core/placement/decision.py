"""A decision as data: the outcome of `decide` (`Decision`), its replicas (`ReplicaAllocation`: a GPU
group on one node, sized) and the per-GPU `Booking`s it makes in the ledger."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllmfit.core.memory import Flags, Footprint, Sizing
from vllmfit.core.model.facts import quick_init
from vllmfit.core.placement.inputs import DecisionPhase


@quick_init
@dataclass(frozen=True)
class Booking:
    """One replica of one deployment on one GPU."""

    deployment: str
    replica: int
    node: str
    index: int
    footprint: Footprint
    kv_beyond: int = 0  # KV bytes granted above its request: what it could give back (Sizing.kv_above_request)
    give_back: str = field(default="", compare=False)  # the spec change that shrinks it to its request (Sizing.give_back)


@dataclass(frozen=True)
class Member:
    """One pod of a multi-node replica after its leader (a LeaderWorkerSet worker): its node, its
    GPUs and the footprint on each (the pipeline stage its ranks run)."""

    node: str
    gpus: tuple[int, ...]
    footprints: tuple[Footprint, ...]


@quick_init
@dataclass(frozen=True)
class ReplicaAllocation:
    """One replica: a TP x PP group on one node, or across several (`workers`: the pods after the
    leader, whose node and GPUs are `node` and `gpus`). `sizing.flags` are this replica's vLLM flags
    (maxModelLen and maxNumSeqs equal across replicas; u may differ by GPU product)."""

    replica: int
    node: str
    gpus: tuple[int, ...]
    sizing: Sizing
    footprints: tuple[Footprint, ...] = ()  # per GPU, aligned with gpus; empty = sizing.footprint on each
    workers: tuple[Member, ...] = ()  # a multi-node replica's other pods, in rank order

    def footprint_on(self, position: int) -> Footprint:
        return self.footprints[position] if self.footprints else self.sizing.footprint

    @property
    def members(self) -> tuple[Member, ...]:
        """Every pod of the replica, the leader first (one for a one-node replica)."""
        leader = Member(self.node, self.gpus, tuple(self.footprint_on(p) for p in range(len(self.gpus))))
        return (leader, *self.workers)


@quick_init
@dataclass(frozen=True)
class Decision:
    """The outcome of `decide`, as data."""

    key: str
    phase: DecisionPhase
    replicas: tuple[ReplicaAllocation, ...] = ()
    flags: Flags | None = None  # replica 0's
    reasons: tuple[str, ...] = ()
    suggestions: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    moved: bool = False  # placed elsewhere than where it was pinned
    message: str = ""  # one line: what the webhook denies with and the Event says
    restored: bool = False  # rebuilt from status.memory (kept where it is, never re-decided)

    @property
    def admitted(self) -> bool:
        return self.phase == "Admitted"

    def bookings(self) -> list[Booking]:
        """One per replica and GPU; every replica holds the KV cache replica 0 was granted, so each
        could give back what replica 0 holds above the request."""
        z0 = self.replicas[0].sizing if self.replicas else None
        above, back = (z0.kv_above_request, z0.give_back) if z0 else (0, "")
        return [
            Booking(self.key, r.replica, r.node, i, r.footprint_on(p), above, back)
            for r in self.replicas
            for p, i in enumerate(r.gpus)
        ] + [
            Booking(self.key, r.replica, m.node, i, fp, above, back)
            for r in self.replicas
            for m in r.workers
            for i, fp in zip(m.gpus, m.footprints)
        ]
