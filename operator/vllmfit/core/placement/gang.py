"""A replica larger than a node: its pods placed as a gang, all of them or none.

One replica of tensorParallelSize x pipelineParallelSize GPUs spans `nodes` pods, one per node
(a LeaderWorkerSet), each with GPUs / nodes GPUs: vLLM numbers its ranks pp_rank x tp + tp_rank and
the pods hold them in order, the leader the first. Every pod's node has GPUs of one type, the same
for all pods, and the nodes share the values of the topology labels they carry
(`defaults.TOPOLOGY_LABELS`: zone, rack, NVLink domain). Each GPU books the footprint of the
pipeline stage its rank runs (`memory.stages`), so the GPUs of different stages may differ, and a
pod takes partly used GPUs where their room allows. Best fit: the set of nodes whose chosen GPUs
keep the least room left (spread: the most), then node names. The bookings of every pod are one
`Decision`, which the ledger books in one step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllmfit.core import defaults
from vllmfit.core.memory import Footprint, Settings, Sizing, fmt_gib, request_only
from vllmfit.core.memory.stages import pods, rank_footprints
from vllmfit.core.model.facts import GpuType
from vllmfit.core.placement import summary
from vllmfit.core.placement.decision import Decision, Member, ReplicaAllocation
from vllmfit.core.placement.inputs import Request, where
from vllmfit.core.placement.ledger import Ledger, NodeSet
from vllmfit.core.placement.search import _full_sizing, _is_mig_type, _shrinkable, _sized


def spans(ledger: Ledger, s: Settings, stated: int | None, pinned: bool = False) -> bool:
    """Whether one replica spans several nodes: `stated` (spec.placement.nodes) above 1, or unset,
    not `pinned` to a node, and no node has tp x pp GPUs of one type."""
    if stated is not None:
        return stated > 1
    if pinned:
        return False
    most = ledger.most_of_one_type()
    return s.gpus > 1 and 0 < most < s.gpus and (pods(s.gpus, most, s.tp) or 0) > 1


def domain(labels: Any) -> tuple[str, ...]:
    """The topology domain of a node: its values of `defaults.TOPOLOGY_LABELS` ('' where absent)."""
    return tuple(labels.get(k, "") for k in defaults.TOPOLOGY_LABELS)


@dataclass(frozen=True)
class Gang:
    """One replica's pods placed: where, the sizing (the fullest stage's) and the room left."""

    members: tuple[Member, ...]
    sizing: Sizing
    score: int

    def order(self, spread: bool) -> tuple[Any, ...]:
        f = self.sizing.flags
        fit = -self.score if spread else self.score
        return ((-f.max_model_len, -self.sizing.granted_tokens) if f else (0, 0)) + (
            fit, tuple((m.node, m.gpus) for m in self.members))


def _per_pod(req: Request, s: Settings, t: GpuType, sizing: Sizing, n: int) -> list[tuple[Footprint, ...]]:
    ranks = rank_footprints(req.model, s, t, sizing)
    g = s.gpus // n
    return [ranks[k * g:(k + 1) * g] for k in range(n)]


def _assign(ledger: Ledger, t: GpuType, nodes: frozenset[str] | None, per_pod: list[tuple[Footprint, ...]],
            spread: bool, sizing: Sizing) -> Gang | None:
    """Each pod onto its own node of `nodes` (None: any), the most demanding pod first, each to the
    node the one-node search would pick for its GPUs (`search._pick`'s order: the key is the node's
    g-th largest headroom; best fit the least that holds the pod, spread the most; then names), and
    there to the GPUs with the least room that hold it (spread: the most)."""
    used: set[str] = set()
    chosen: dict[int, Member] = {}
    score = 0
    g = len(per_pod[0])
    index = ledger.group_index(t, g)  # nodes with g GPUs of type t, by their g-th largest headroom

    def free(nd: str) -> bool:
        return nd not in used and (nodes is None or nd in nodes)

    for k in sorted(range(len(per_pod)), key=lambda k: (-max(fp.total for fp in per_pod[k]), k)):
        need = max(fp.total for fp in per_pod[k])
        hit = next(index.walk(need, spread, free), None)
        if hit is None:
            return None
        key, nd = hit
        fit = [(h, i) for i in ledger.type_indices(nd, t) if (h := ledger.heads[(nd, i)]) >= need]
        take = sorted(fit, key=lambda e: (-e[0], e[1]))[:g] if spread else sorted(fit)[:g]
        used.add(nd)
        chosen[k] = Member(nd, tuple(sorted(i for _, i in take)), per_pod[k])
        score += key - need
    return Gang(tuple(chosen[k] for k in range(len(per_pod))), sizing, score)


def _domains(ledger: Ledger, matching: NodeSet | None) -> list[frozenset[str] | None]:
    """The candidate nodes grouped by topology domain (`domain`), in order; [None] (every node, no
    set built) when no node carries a topology label and no selector narrows them."""
    names = ledger.nodes if matching is None else matching.names
    out: dict[tuple[str, ...], set[str]] = {}
    for nd in names:
        out.setdefault(domain(ledger.nodes[nd].labels), set()).add(nd)
    if matching is None and len(out) == 1:
        return [None]
    return [frozenset(v) for _, v in sorted(out.items())]


def place_one(ledger: Ledger, req: Request, s: Settings, matching: NodeSet | None, spread: bool) -> Gang | None:
    """The best gang for one replica on the ledger as it is, or None. It is placed and booked at
    its KV request: a replica across nodes is granted nothing above it."""
    s = request_only(s)
    stated = req.spec.placement.nodes
    best: Gang | None = None
    domains = _domains(ledger, matching)
    for t in (ledger.gpu_types() if matching is None else matching.types):
        full = _full_sizing(req.model, s, t)
        if _is_mig_type(ledger, t) or isinstance(full, str):
            continue
        n = pods(s.gpus, summary.most_of_type(ledger, t), s.tp, stated)
        if n is None:
            continue
        g = s.gpus // n
        for nodes in domains:
            if nodes is not None and len(nodes) < n:
                continue
            got = _assign(ledger, t, nodes, _per_pod(req, s, t, full, n), spread, full) if full.fits else None
            if got is None and _shrinkable(s):  # unset values lowered to the n-th roomiest node's room
                keys = sorted((k for nd in (nodes if nodes is not None else ledger.nodes)
                               if (k := ledger.node_group_key(nd, t, g)) is not None), reverse=True)
                sized = _sized(req.model, s, t, keys[n - 1]) if len(keys) >= n else None
                if sized is not None and sized.fits:
                    got = _assign(ledger, t, nodes, _per_pod(req, s, t, sized, n), spread, sized)
            if got is not None and (best is None or got.order(spread) < best.order(spread)):
                best = got
    return best


def why_not(ledger: Ledger, req: Request, s: Settings, matching: NodeSet | None) -> list[str]:
    """Why no gang fits: what one replica needs, then one line per node (the first
    `defaults.GANG_REASON_NODES`, then how many more), at its KV request as `place_one` sizes it."""
    s = request_only(s)
    names = sorted(ledger.nodes) if matching is None else list(matching.names)
    stated = req.spec.placement.nodes
    out: list[str] = []
    for t in (ledger.gpu_types() if matching is None else matching.types):
        full = _full_sizing(req.model, s, t)
        if _is_mig_type(ledger, t):
            continue
        if isinstance(full, str):
            out.append(f"{t.product}: {full}")
            continue
        per_node = summary.most_of_type(ledger, t)
        n = pods(s.gpus, per_node, s.tp, stated)
        if n is None:
            out.append(f"{t.product}: {s.gpus} GPUs (tensorParallelSize {s.tp} x pipelineParallelSize {s.pp}) do not "
                       f"split into " + (f"placement.nodes {stated} pods" if stated else "pods") +
                       f" of at most {per_node} GPUs, the most one node has")
            continue
        g = s.gpus // n
        need = min(max(fp.total for fp in pod) for pod in _per_pod(req, s, t, full, n))  # the full context's
        hosts = [nd for nd in names if len(ledger.type_indices(nd, t)) >= g]
        roomy = [nd for nd in hosts if sum(1 for i in ledger.type_indices(nd, t) if ledger.heads[(nd, i)] >= need) >= g]
        at = f" at maxModelLen {full.flags.max_model_len}" if _shrinkable(s) and full.flags else ""
        out.append(f"needs {n} nodes with {g} {t.product} GPUs each, {fmt_gib(need)} of budget left on each GPU"
                   f"{at} (tensorParallelSize {s.tp} x pipelineParallelSize {s.pp}); "
                   f"{len(roomy)} of the {len(names)} nodes have that room")
        lines = []
        for nd in names:
            have = ledger.type_indices(nd, t)
            room = sum(1 for i in have if ledger.heads[(nd, i)] >= need)
            if not have:
                lines.append(f"{nd}: no {t.product} GPUs")
            elif len(have) < g:
                lines.append(f"{nd}: {len(have)} {t.product} GPUs, a pod needs {g}")
            elif room < g:
                lines.append(f"{nd}: {room} of its {len(have)} {t.product} GPUs have {fmt_gib(need)} of budget left, "
                             f"a pod needs {g}")
        if len(roomy) >= n:
            lines.append(f"the {len(roomy)} nodes with room do not share one topology domain "
                         f"({', '.join(defaults.TOPOLOGY_LABELS)})")
        shown = lines[:defaults.GANG_REASON_NODES]
        out += shown + ([f"and {len(lines) - len(shown)} more nodes"] if len(lines) > len(shown) else [])
    return out or ["no node has GPUs this deployment can use"]


def decide(ledger: Ledger, req: Request, s: Settings, matching: NodeSet | None,
           keep: Sequence[ReplicaAllocation], explain: bool) -> Decision:
    """Every replica of `req` as a gang (pending replicas booked for the next one's search)."""
    spec, pin = req.spec, req.spec.placement
    if pin.node_name or pin.gpu_indices:
        why = "placement.nodeName and placement.gpuIndices pin one node; a replica spanning nodes is placed by vllmfit"
        return Decision(req.key, "Rejected", reasons=(why,), message=f"{req.key}: {why}")
    if ledger.multi_node:
        why = f"a replica of {s.gpus} GPUs spans nodes here: {ledger.multi_node}"
        return Decision(req.key, "Unschedulable", reasons=(why,), message=f"{why[0].upper()}{why[1:]}.")
    spread = pin.policy == "spread"
    placed = {r.replica: r for r in keep}
    pending = f"{req.key}\x00pending"
    failure: list[str] = []
    try:
        if placed:
            ledger.add_bookings(pending, Decision(pending, "Admitted", tuple(placed.values())).bookings())
        for replica in range(spec.replicas):
            if replica in placed:
                continue
            got = place_one(ledger, req, s, matching, spread)
            if got is None:
                failure = why_not(ledger, req, s, matching) if explain else []
                break
            lead, rest = got.members[0], got.members[1:]
            alloc = ReplicaAllocation(replica, lead.node, lead.gpus, got.sizing, lead.footprints, rest)
            placed[replica] = alloc
            ledger.add_bookings(pending, Decision(pending, "Admitted", (alloc,)).bookings())
    finally:
        ledger.release(pending)
    replicas = tuple(placed[r] for r in sorted(placed))
    flags = replicas[0].sizing.flags if replicas else None
    warnings = tuple(dict.fromkeys(w for r in replicas for w in r.sizing.warnings))
    if len(replicas) < spec.replicas:
        head = f"{len(replicas)}/{spec.replicas} replicas placed; replica {len(replicas)}: " if replicas else ""
        msg = f"{head}no set of nodes has room for a replica" + (": " + "; ".join(failure[:3]) if failure else "")
        return Decision(req.key, "Unschedulable", replicas, flags, tuple(failure), (), warnings, False, msg + ".")
    on = ", ".join(" + ".join(where(m.node, m.gpus) for m in r.members) for r in replicas)
    return Decision(req.key, "Admitted", replicas, flags, (), (), warnings, False, f"admitted on {on}")
