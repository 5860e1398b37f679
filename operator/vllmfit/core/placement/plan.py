"""A whole-cluster plan: every deployment decided in a deterministic order."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from vllmfit.core import memory
from vllmfit.core.memory import Flags, fmt_gib
from vllmfit.core.placement.decide import decide
from vllmfit.core.placement.decision import Booking, Decision
from vllmfit.core.placement.inputs import NodeInfo, Request
from vllmfit.core.placement.ledger import Ledger
from vllmfit.core.placement.restore import restored_decision

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
    """Place every request in order (earlier first). Deployments already `admitted` keep their
    bookings (restored as they are, never moved, never re-decided); a booking on a GPU the
    nodes do not have is dropped with an error. `kv_grant`: the cluster's default KV grant.
    A fleet-size plan allocates millions of objects: `vllmfit plan` pauses Python's garbage
    collector around it (cli.plan.collector_paused), a process-wide switch only a shell may turn."""
    node_list = sorted(nodes, key=lambda nd: nd.name)
    ledger = Ledger(node_list, kv_grant)
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
    result.errors.sort()
    return result

