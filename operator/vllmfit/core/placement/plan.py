"""A whole-cluster plan: every deployment decided in a deterministic order."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from vllmfit.core import memory
from vllmfit.core.memory import Flags, fmt_gib
from vllmfit.core.placement.decide import decide
from vllmfit.core.placement.decision import Booking, Decision
from vllmfit.core.placement.inputs import NodeInfo, Request, settings_of
from vllmfit.core.placement.ledger import Ledger
from vllmfit.core.placement.restore import restored_decision
from vllmfit.core.placement.search import _sized, grant_room

# --- Plans -------------------------------------------------------------------------------------


@dataclass
class Plan:
    ledger: Ledger
    decisions: dict[str, Decision] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # per-document problems (name: what is wrong)
    warnings: list[str] = field(default_factory=list)  # plan-wide (node agent, restored over budget)
    requests: dict[str, Request] = field(default_factory=dict)


def plan(
    nodes: Iterable[NodeInfo],
    requests: Iterable[Request],
    *,
    admitted: Mapping[str, list[Booking]] | None = None,
    policy: memory.Policy = "vllm",
    admitted_flags: Mapping[str, Flags] | None = None,
    suggest: bool = True,
    kv_grant: memory.KvGrant = memory.DEFAULT_KV_GRANT,
) -> Plan:
    """Place every request in order (earlier first), each at its KV request; then grant each, in the
    same order, its KV cache between request and limit in the room its GPUs have left
    (`_grant`): nobody is refused while a neighbour holds more than its request, and a later
    request never moves an earlier one. Deployments already `admitted` keep their
    bookings (restored as they are, never moved, never re-decided); a booking on a GPU the
    nodes do not have is dropped with an error. `kv_grant`: the cluster's default KV grant.
    A fleet-size plan allocates millions of objects: `vllmfit plan` pauses Python's garbage
    collector around it (cli.plan.collector_paused), a process-wide switch only a shell may turn."""
    node_list = sorted(nodes, key=lambda nd: nd.name)
    ledger = Ledger(node_list, replace(kv_grant, grants=False))  # every request first
    result = Plan(ledger)
    for nd in node_list:
        result.warnings.extend(nd.warnings)
    for key, bookings in sorted((admitted or {}).items()):
        ok = [b for b in bookings if ledger.slot(b.node, b.index)]
        for b in bookings:
            if not ledger.slot(b.node, b.index):
                result.errors.append(
                    f"{key}: admitted on {b.node} GPU {b.index}, which no node describes; "
                    "that booking is not counted"
                )
        ledger.restore(key, ok)
        result.decisions[key] = restored_decision(key, ok, (admitted_flags or {}).get(key))
    for node, index in ledger.over_budget():
        result.warnings.append(
            f"{node} GPU {index} is over budget by "
            f"{fmt_gib(-ledger.headroom_bytes(node, index))} with the bookings read from status"
        )
    for req in sorted(requests, key=lambda r: r.order):
        result.requests[req.key] = req
        if admitted and req.key in admitted:
            continue
        d = decide(ledger, req, policy=policy, suggest=suggest)
        ledger.book(d)
        result.decisions[req.key] = d
    ledger.kv_grant = kv_grant
    for key, d in list(result.decisions.items()):
        if key in result.requests and d.admitted and not d.restored:
            result.decisions[key] = _grant(ledger, result.requests[key], d, policy)
    result.errors.sort()
    return result


def _grant(ledger: Ledger, req: Request, d: Decision, policy: memory.Policy) -> Decision:
    """`d`, placed at its KV request, with its KV cache grown as a search on this ledger grows it
    (search.grant_room: a fair share or the room its GPUs have left, at most its limit), on the GPUs
    it holds; booked. Unchanged when it does not grow: its context or batch were lowered to fit, or
    its replicas are on mixed GPU products."""
    s = settings_of(req, policy, ledger.kv_grant)
    z0 = d.replicas[0].sizing if d.replicas else None
    slots = [ledger.slot(r.node, i) for r in d.replicas for i in r.gpus]
    if not s.kv_grow or z0 is None or z0.flags is None or any(r.footprints for r in d.replicas) or \
            None in slots or len({sl.gpu for sl in slots if sl}) != 1:
        return d
    t = slots[0].gpu  # type: ignore[union-attr]
    floor = _sized(req.model, memory.request_only(s), t, memory.UNLIMITED)
    if floor.flags != z0.flags or floor.footprint != z0.footprint:
        return d  # placed with a lowered context or batch: it keeps its request
    own = ledger.release(req.key)
    sharing = Counter((b.node, b.index) for b in own)  # replicas of it on one GPU share its room
    room = min(grant_room(ledger, s, r.node, r.gpus, z0.footprint.total,
                          min(ledger.headroom_bytes(r.node, i) // sharing[(r.node, i)] for i in r.gpus))
               for r in d.replicas)
    grown = _sized(req.model, s, t, room)
    if not grown.fits or grown.footprint.kv_cache <= z0.footprint.kv_cache:
        ledger.add_bookings(req.key, own)
        return d
    replicas = tuple(replace(r, sizing=grown) for r in d.replicas)
    warnings = tuple(dict.fromkeys([*(w for w in d.warnings if w not in z0.warnings), *grown.warnings]))
    out = replace(d, replicas=replicas, flags=grown.flags, warnings=warnings)
    ledger.add_bookings(req.key, out.bookings())
    return out

