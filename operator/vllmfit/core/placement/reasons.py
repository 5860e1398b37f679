"""Why a deployment does not fit, grouped by cause like the kube-scheduler's FitError:

    0/20 nodes are available: 12 GPU memory (needs 33.0 GiB, largest budget left 19.8 GiB on gpu-07 GPU 3),
    8 node(s) didn't match placement.nodeSelector.

Each node gets one cause (its closest to fitting); causes are counted over nodes and carry the best
candidate's numbers. As in kube-scheduler's `FitError.Error()` (pkg/scheduler/framework/types.go),
the groups read "<count> <reason>", sorted as strings, joined with ", ". The per-node line
(`_node_why_not`) stays for a pinned node, where there is only one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from vllmfit.core import memory
from vllmfit.core.memory import Settings, fmt_gib
from vllmfit.core.placement import affinity
from vllmfit.core.placement.inputs import Request, gpu_label, refusal, where
from vllmfit.core.placement.ledger import Ledger, NodeSet
from vllmfit.core.placement.search import _UNLIMITED, _full_sizing, _is_mig_type, _min_need, _shrinkable

NO_NODE = "0/{} nodes are available"
"""kube-scheduler's NoNodeAvailableMsg."""


@dataclass(frozen=True)
class _Why:
    """One node's closest cause. kind: memory, few, small, nogpu. For memory: `need` per GPU,
    `free` on the node's best group `gpus`; for few: `free` is how many GPUs of one type it has."""

    kind: str
    product: str = ""
    need: int = 0
    free: int = 0
    node: str = ""
    gpus: tuple[int, ...] = ()
    text: str = ""  # small: the memory model's reason
    missing: int = _UNLIMITED  # bytes short of fitting (sort key)


_INDEXED_FROM = 16
"""From this many nodes on, causes are read from the ledger's headroom indices (one pass over each
GPU type's sorted list) instead of node by node; both give the same causes (tested)."""


def _why_not(
    ledger: Ledger,
    req: Request,
    s: Settings,
    matching: NodeSet | None,
    only: Sequence[str] | None = None,
    indexed: bool | None = None,
) -> list[str]:
    """Why no node (or no node of `only`) takes one more replica: the causes grouped as the
    kube-scheduler groups them, each "<count> <reason>", sorted as strings."""
    allowed = ledger.nodes.keys() if matching is None else matching.members
    names = only if only is not None else ledger.nodes
    if indexed is None:
        indexed = only is None and len(ledger.nodes) >= _INDEXED_FROM
    if indexed:
        whys = _indexed_causes(ledger, req, s, matching)
    else:
        whys = [_node_cause(ledger, req, s, name) for name in names if name in allowed]
    barred: dict[str, int] = {}  # the kube-scheduler's words for a cordon or a taint -> nodes
    for name in names if matching is not None else ():
        if name not in allowed and (why := refusal(ledger.nodes[name], req.spec)) is not None:
            barred[why] = barred.get(why, 0) + 1
    excluded = sum(1 for name in names if name not in allowed) - sum(barred.values()) if matching is not None else 0
    policy = _policy_line(ledger, [w.node for w in whys if _policy_is_a_cause(ledger, w)])
    most = ledger.most_of_one_type()
    whole = [memory.one_node_reason(s, most)] if s.gpus > 1 and 0 < most < s.gpus else []
    return sorted(_grouped(whys, excluded, req, s, ledger) + [f"{n} {why}" for why, n in barred.items()]) + (
        [policy] if policy else []) + whole


def _policy_is_a_cause(ledger: Ledger, w: _Why) -> bool:
    """Whether the budget policy is why this node refuses: memory is short by no more than the
    policy holds back of one of its GPUs (a roomier policy could admit it). Too few GPUs, a GPU
    type the model cannot run on or an invalid policy label are not the policy's doing."""
    if w.kind != "memory":
        return False
    return any(w.missing <= sl.capacity_bytes - sl.budget_bytes
               for sl in ledger.nodes[w.node].gpus if sl.gpu.product == w.product)


def _policy_line(ledger: Ledger, names: Iterable[str]) -> str:
    """The budget policies of these nodes and what they hold back of each GPU product: 'budget policy
    (default) 0.9 x capacity - 2.0 GiB holds back 9.9 GiB of each NVIDIA-H100-80GB-HBM3'."""
    held: dict[tuple[str, str], dict[str, str]] = {}
    for name in names:
        for src, rule, product, h in ledger.nodes[name].held_back:
            held.setdefault((src, rule), {})[product] = h
    return "; ".join(
        f"budget policy ({src}) {rule} holds back "
        + ", ".join(f"{h} of each {p}" for p, h in sorted(per.items()))
        for (src, rule), per in sorted(held.items())
    )


def _grouped(whys: list[_Why], excluded: int, req: Request, s: Settings, ledger: Ledger) -> list[str]:
    groups: dict[tuple[object, ...], list[_Why]] = {}
    shown: dict[int, str] = {}  # need -> as printed: GPU types whose need prints the same share a group
    for w in whys:
        if w.kind == "memory":
            key: tuple[object, ...] = ("memory", shown.get(w.need) or shown.setdefault(w.need, fmt_gib(w.need)))
        else:
            key = ("small", w.product, w.text) if w.kind in ("small", "policy") else (w.kind,)
        groups.setdefault(key, []).append(w)
    needs = set(shown.values())
    out = []
    for key, members in groups.items():
        best = members[0]
        if key[0] == "memory":  # the best candidate, with its GPUs
            best = min(members, key=lambda w: (-w.free, w.node))
            if not best.gpus:
                best = replace(best, gpus=_best_group(ledger, best.node, best.product, s.gpus))
        out.append(f"{len(members)} {_group_text(str(key[0]), members, best, s, len(needs) > 1)}")
    if excluded:
        out.append(f"{excluded} node(s) didn't match {_selector_words(req)}")
    return sorted(out)


def _group_text(kind: str, members: list[_Why], best: _Why, s: Settings, name_product: bool) -> str:
    n = s.gpus
    if kind == "nogpu":
        return "node(s) had no GPUs"
    if kind == "few":
        most = max(w.free for w in members)
        return f"node(s) had fewer than {n} GPUs of one type (at most {most})"
    first = members[0]
    if first.kind == "policy":
        return f"node(s) refused by their {first.text}"
    if kind == "small":
        return f"node(s) with {first.product}: {first.text}"
    least = "at least " if _shrinkable(s) else ""
    on = "/".join(sorted({w.product for w in members})) + ": " if name_product else ""
    if n == 1:
        return (f"GPU memory ({on}needs {least}{fmt_gib(first.need)}, largest budget left "
                f"{fmt_gib(max(best.free, 0))} on {where(best.node, best.gpus)})")
    # a group is as roomy as its fullest GPU: name the best group and that figure, not a "largest"
    return (f"GPU memory ({on}needs {least}{fmt_gib(first.need)} on each of {n} GPUs, the best {n} have "
            f"{fmt_gib(max(best.free, 0))} or more left each: {where(best.node, best.gpus)})")


def _selector_words(req: Request) -> str:
    sel = bool(req.spec.placement.node_selector)
    try:
        aff = affinity.required_terms(req.spec) is not None
    except ValueError:
        aff = False
    if sel and aff:
        return "placement.nodeSelector or the podTemplate node affinity"
    return "the podTemplate node affinity" if aff else "placement.nodeSelector"


def _node_cause(ledger: Ledger, req: Request, s: Settings, name: str) -> _Why:
    """The closest cause on one node: memory (least missing) before too few GPUs before a GPU
    type the model can never run on."""
    n = s.gpus
    node = ledger.nodes[name]
    if node.error:  # an invalid budget policy label: the node takes nothing
        return _Why("policy", node=name, text=node.error)
    types = sorted({sl.gpu for sl in node.gpus if n == 1 or not sl.mig}, key=lambda t: t.product)
    if not types:
        return _Why("nogpu", node=name)
    best: _Why | None = None
    few: _Why | None = None
    small: _Why | None = None
    for t in types:
        full = _full_sizing(req.model, s, t)
        need = _min_need(req.model, s, t)
        if isinstance(full, str) or need is None or not full.fits:
            text = full if isinstance(full, str) else "; ".join(full.reasons)
            small = small or _Why("small", t.product, node=name, text=text)
            continue
        heads = sorted(
            ((ledger._head[(name, sl.index)], sl.index) for sl in node.gpus if sl.gpu == t),
            key=lambda e: (-e[0], e[1]),
        )
        if len(heads) < n:
            if few is None or len(heads) > few.free:
                few = _Why("few", t.product, free=len(heads), node=name)
            continue
        h = heads[n - 1][0]
        w = _Why("memory", t.product, need, h, name, tuple(sorted(i for _, i in heads[:n])), missing=need - h)
        if best is None or w.missing < best.missing:
            best = w
    result = best or few or small
    assert result is not None
    return result


def _best_group(ledger: Ledger, node: str, product: str, n: int) -> tuple[int, ...]:
    """The n GPUs of `product` on `node` with the most headroom (ties: lower index), sorted."""
    heads = sorted(
        ((ledger._head[(node, sl.index)], sl.index) for sl in ledger.nodes[node].gpus
         if sl.gpu.product == product and (n == 1 or not sl.mig)),
        key=lambda e: (-e[0], e[1]),
    )
    return tuple(sorted(i for _, i in heads[:n]))


def _indexed_causes(ledger: Ledger, req: Request, s: Settings, matching: NodeSet | None) -> list[_Why]:
    """`_node_cause` for every node `matching` allows (None: all), from the ledger's indices: per
    GPU type, one pass over its sorted headroom list (one GPU) or its group index (n GPUs). The
    same rules: memory (least missing, the first type by product on ties) before too few GPUs
    (the most of one type) before a type the model never runs on (the first by product)."""
    n = s.gpus
    allowed = None if matching is None else matching.members
    memory: dict[str, _Why] = {}
    few: dict[str, _Why] = {}
    small: dict[str, _Why] = {}
    for t in ledger.gpu_types():  # by product, as _node_cause iterates them
        if n > 1 and _is_mig_type(ledger, t):
            continue
        full = _full_sizing(req.model, s, t)
        need = _min_need(req.model, s, t)
        if isinstance(full, str) or need is None or not full.fits:
            text = full if isinstance(full, str) else "; ".join(full.reasons)
            for _, nd, _ in ledger.free_index(t):
                if nd not in small and (allowed is None or nd in allowed):
                    small[nd] = _Why("small", t.product, node=nd, text=text)
            continue
        if n == 1:
            top: dict[str, int] = {}
            idx: dict[str, int] = {}
            for h, nd, i in ledger.free_index(t):  # ascending: the last of a node is its largest
                if nd not in top or h > top[nd]:
                    top[nd], idx[nd] = h, i
            tops = ((nd, h, (idx[nd],)) for nd, h in top.items())
        else:
            tops = ((nd, h, ()) for h, nd in ledger.group_index(t, n))
            for nd, types in ledger._by_type.items():
                have = len(types.get(t, ()))
                if 0 < have < n and (allowed is None or nd in allowed) and (nd not in few or have > few[nd].free):
                    few[nd] = _Why("few", t.product, free=have, node=nd)
        for nd, h, gpus in tops:
            if allowed is not None and nd not in allowed:
                continue
            w = _Why("memory", t.product, need, h, nd, gpus, missing=need - h)
            old = memory.get(nd)
            if old is None or w.missing < old.missing:
                memory[nd] = w
    out = []
    for nd in ledger.nodes if allowed is None else matching.names:  # type: ignore[union-attr]
        w = memory.get(nd) or few.get(nd) or small.get(nd)
        if ledger.nodes[nd].error:
            w = _Why("policy", node=nd, text=ledger.nodes[nd].error)
        out.append(w if w is not None else _Why("nogpu", node=nd))
    return out


def _node_why_not(ledger: Ledger, req: Request, s: Settings, name: str) -> str:
    """'node: what its best group needs and has', for a node the spec pins."""
    w = _node_cause(ledger, req, s, name)
    if w.kind == "policy":
        return f"{name}: {w.text}"
    if w.kind == "nogpu":
        return f"{name}: no GPUs"
    if w.kind == "small":
        return f"{name}: {w.product}: {w.text}"
    if w.kind == "few":
        return f"{name}: needs {s.gpus} GPUs of one type, has {w.free}"
    least = "at least " if _shrinkable(s) else ""
    if s.gpus == 1:
        return f"{name}: {gpu_label(w.gpus[0])} needs {least}{fmt_gib(w.need)}, {fmt_gib(max(w.free, 0))} of budget left"
    return (
        f"{name}: needs {s.gpus} GPUs with {least}{fmt_gib(w.need)} of budget left, "
        f"{where(name, w.gpus)} has {fmt_gib(max(w.free, 0))} or more on each"
    )
