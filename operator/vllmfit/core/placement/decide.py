"""`decide`: the one entry point the CLI, the webhook and the operator share. Place a deployment
without changing the ledger; when it does not fit, add checked fixes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from vllmfit.core import memory
from vllmfit.core.memory import Flags, Sizing
from vllmfit.core.placement import affinity
from vllmfit.core.placement.decision import Booking, Decision, Member, ReplicaAllocation
from vllmfit.core.placement.fixes import _suggest
from vllmfit.core.placement.inputs import Request, settings_of
from vllmfit.core.placement.ledger import Ledger
from vllmfit.core.placement.place import _decide
from vllmfit.core.placement.search import _FEW_NODES


def decide(
    ledger: Ledger,
    req: Request,
    *,
    policy: memory.Policy = "vllm",
    suggest: bool = True,
    keep: Sequence[ReplicaAllocation] = (),
    explain: bool = True,
) -> Decision:
    """Check and place every replica of `req` without changing the ledger.

    Bookings the deployment already holds are ignored (an update is checked with its own
    allocation released first). On a snapshot (`ledger.frozen`) the work happens on a scratch
    copy, so any number of threads may decide on one snapshot at once; a mutable ledger (the
    CLI's plan, which owns it) is changed while deciding and given back as it was. Pinned placement is tried first; if it overfits and
    allowReschedule permits, or if nothing is pinned, the best-fit search runs over every
    node matching the node selector. When it does not fit, `suggestions` lists changes that
    were each checked to make it fit (omitted with suggest=False). explain=False: "does it fit?"
    only: an Unschedulable decision carries neither reasons nor suggestions.
    """
    if ledger.frozen:
        ledger = ledger.scratch()
    own = ledger.release(req.key)
    s = settings_of(req, policy, ledger.kv_grant)  # once: the decision and its fixes size the same
    try:
        d = _decide(ledger, req, policy, keep, explain, s=s)
        if suggest and explain and d.phase == "Unschedulable":
            fixes = tuple(_suggest(ledger, req, policy, len(d.replicas), s))
            d = replace(
                d,
                suggestions=fixes,
                message=d.message + ((" " if d.message.endswith(".") else ". ") + "Fits with: " + "; or ".join(fixes)
                                     if fixes else ""),
            )
        return d
    finally:
        ledger.add_bookings(req.key, own)


def quick(ledger: Ledger, req: Request, most_replicas: int) -> bool:
    """Whether deciding `req` on `ledger` (without fixes) is a few bisections whatever the size of
    the cluster: at most `most_replicas` replicas, every node a candidate (no nodeSelector, no
    required node affinity), and at most a few nodes that may refuse its pods (a search steps past
    the GPUs of each such node). docs/placement.md, "The bound"."""
    spec = req.spec
    return (spec.replicas <= most_replicas and not spec.placement.node_selector
            and affinity.required_terms(spec) is None and len(ledger.census.refusing) <= _FEW_NODES)


def held_replicas(ledger: Ledger, key: str, below: int, flags: Flags | None = None) -> list[ReplicaAllocation]:
    """The allocations of the replicas 0..below-1 that `key` holds in the ledger, rebuilt from its
    bookings; `flags` (its current flags) keep the context and concurrency of replicas added."""
    return _kept_replicas([b for b in ledger.bookings_of(key) if b.replica < below], flags)


def _kept_replicas(bookings: list[Booking], flags: Flags | None) -> list[ReplicaAllocation]:
    """Replica allocations rebuilt from the bookings of replicas that stay."""
    by_rep: dict[int, list[Booking]] = {}
    for b in bookings:
        by_rep.setdefault(b.replica, []).append(b)
    return [_allocation_from_bookings(r, bs, flags) for r, bs in sorted(by_rep.items())]


def _allocation_from_bookings(
    replica: int, bs: list[Booking], flags: Flags | None = None
) -> ReplicaAllocation:
    fp = max((b.footprint for b in bs), key=lambda f: f.total)
    by_node: dict[str, list[Booking]] = {}  # a multi-node replica: its leader's node was booked first
    for b in bs:
        by_node.setdefault(b.node, []).append(b)
    pods = [sorted(p, key=lambda b: b.index) for p in by_node.values()]
    lead = pods[0]
    return ReplicaAllocation(
        replica,
        lead[0].node,
        tuple(b.index for b in lead),
        Sizing(True, fp, flags, 0, 0, 0.0),
        tuple(b.footprint for b in lead),
        tuple(Member(p[0].node, tuple(b.index for b in p), tuple(b.footprint for b in p)) for p in pods[1:]),
    )
