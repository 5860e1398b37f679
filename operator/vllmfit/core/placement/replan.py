"""Re-placement after a node vanished or filled up: move the fewest deployments."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from vllmfit.core import memory
from vllmfit.core.memory import Flags
from vllmfit.core.placement.decide import _kept_replicas
from vllmfit.core.placement.decision import Decision
from vllmfit.core.placement.fixes import _suggest
from vllmfit.core.placement.inputs import Request
from vllmfit.core.placement.ledger import Ledger
from vllmfit.core.placement.place import _decide

# --- Re-placement --------------------------------------------------------------------------------


@dataclass
class Replan:
    """What `replan` did: the deployments it moved, and those that must wait."""

    moves: dict[str, Decision] = field(default_factory=dict)  # admitted: book these (already booked)
    waiting: dict[str, Decision] = field(default_factory=dict)  # Unschedulable (or Rejected)
    evicted: list[str] = field(default_factory=list)  # every deployment that had to leave its GPUs


def replan(
    ledger: Ledger,
    requests: Mapping[str, Request],
    *,
    policy: memory.Policy = "vllm",
    flags: Mapping[str, Flags] | None = None,
    place: bool = True,
    why_not_placed: str = "",
) -> Replan:
    """Restore the invariant after a node disappeared or its GPUs filled up (foreign use grew).

    Only deployments that must move do: those booked on GPUs that no longer exist, plus, per
    over-budget GPU, the fewest replicas whose removal brings it back under budget (greedy:
    the replica covering the most overflow first, the newest deployment on ties). Each affected
    deployment keeps its unaffected replicas and has the evicted ones re-placed, oldest first;
    `flags` (its current flags, e.g. status.flags) keeps their context and concurrency.
    `place=False` is the cheap fallback when re-placing takes too long: the evictions only
    (linear in the bookings), every affected deployment waits (Unschedulable, `why_not_placed`).
    Changes the ledger: moves are booked; a deployment that must wait keeps only the replicas
    that still fit. `requests` must hold the affected deployments.
    """
    result = Replan()
    lost: dict[str, set[int]] = {}  # deployment -> replicas that must move
    for key in ledger.deployments():
        for b in ledger.bookings_of(key):
            if ledger.slot(b.node, b.index) is None:
                lost.setdefault(key, set()).add(b.replica)
    for key, reps in lost.items():
        _release_replicas(ledger, key, reps)
    for key, rep in _evictions(ledger, requests):
        lost.setdefault(key, set()).add(rep)
    order = sorted(lost, key=lambda k: requests[k].order if k in requests else ("", k))
    result.evicted = order
    for key in order:
        req = requests.get(key)
        if req is None:
            result.waiting[key] = Decision(
                key,
                "Unschedulable",
                reasons=("spec unknown to replan",),
                message=f"{key}: spec unknown to replan",
            )
            continue
        if not place:
            result.waiting[key] = Decision(key, "Unschedulable", reasons=(why_not_placed,), message=why_not_placed)
            continue
        rest = ledger.release(key)
        keep = _kept_replicas(rest, (flags or {}).get(key))
        d = _decide(ledger, req, policy, keep)
        if d.admitted:
            ledger.book(d)
            result.moves[key] = d
        else:
            ledger.add_bookings(key, rest)
            fixes = tuple(_suggest(ledger, req, policy))
            result.waiting[key] = replace(d, suggestions=fixes)
    return result


def _release_replicas(ledger: Ledger, key: str, replicas: set[int]) -> None:
    rest = [b for b in ledger.bookings_of(key) if b.replica not in replicas]
    ledger.release(key)
    ledger.add_bookings(key, rest)


def _evictions(ledger: Ledger, requests: Mapping[str, Request]) -> list[tuple[str, int]]:
    """(deployment, replica) pairs to evict so no GPU is over budget: greedily the replica that
    covers the most remaining overflow, ties to the newest deployment."""
    out: list[tuple[str, int]] = []
    while True:
        over = {k: -ledger.headroom_bytes(*k) for k in ledger.over_budget()}
        if not over:
            return out
        cover: dict[tuple[str, int], int] = {}
        for k, excess in over.items():
            for b in ledger.bookings_on(*k):
                cover[(b.deployment, b.replica)] = cover.get((b.deployment, b.replica), 0) + min(
                    b.footprint.total, excess
                )
        if not cover:  # foreign use alone exceeds the budget and nothing of ours is there
            return out
        dep, rep = max(
            cover, key=lambda c: (cover[c], requests[c[0]].order if c[0] in requests else ("", c[0]), c[1])
        )
        _release_replicas(ledger, dep, {rep})
        out.append((dep, rep))
