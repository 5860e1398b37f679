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
from vllmfit.core.model.facts import GpuType
from vllmfit.core.placement import affinity, summary
from vllmfit.core.placement.census import BY_PRODUCT
from vllmfit.core.placement.inputs import Request, gpu_label, where
from vllmfit.core.placement.ledger import Ledger, NodeSet
from vllmfit.core.placement.search import _UNLIMITED, _full_sizing, _min_need, _shrinkable

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
"""From this many nodes on, causes are counted from the node set's summary and the ledger's headroom
indices (core.placement.summary) instead of node by node; both give the same causes (tested)."""


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
    groups = _Groups()
    if indexed:
        _indexed_causes(ledger, req, s, matching, groups)
    else:
        for name in names:
            if name in allowed:
                groups.add(_node_cause(ledger, req, s, name))
    # the budget policy is a cause where a group's best candidate (the node closest to fitting) is
    # short by no more than its policy holds back (issue 31); both paths judge the same groups
    causes = sorted({g.best.node for g in groups.groups.values() if _policy_is_a_cause(ledger, g.best)})
    barred: dict[str, int] = {}  # the kube-scheduler's words for a cordon or a taint -> nodes
    excluded = 0
    if matching is not None and indexed:
        barred, excluded = summary.barred(ledger, matching, req.spec)
    elif matching is not None:
        barred, excluded = summary.count_barred(ledger, names, allowed, req.spec)
    policy = _policy_line(ledger, causes)
    most = ledger.most_of_one_type()
    whole = [memory.one_node_reason(s, most)] if s.gpus > 1 and 0 < most < s.gpus else []
    return sorted(groups.lines(excluded, req, s, ledger) + [f"{n} {why}" for why, n in barred.items()]) + (
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
    return summary._policy_line(ledger, names)


@dataclass
class _Group:
    """Nodes with one cause: how many, one of them (`first`), the best candidate (memory: the most
    room, then the node name), the most GPUs of one type (few), the GPU products (memory)."""

    count: int
    first: _Why
    best: _Why
    most: int
    products: set[str]


class _Groups:
    """Causes counted per group, as the kube-scheduler counts them: node by node (`add`) or many
    nodes with the same cause at once (`add_many`, the indexed path)."""

    def __init__(self) -> None:
        self.groups: dict[tuple[object, ...], _Group] = {}
        self.shown: dict[int, str] = {}  # need -> as printed: GPU types whose need prints the same share a group

    def add(self, w: _Why, count: int = 1) -> None:
        if w.kind == "memory":
            key: tuple[object, ...] = ("memory", self.shown.get(w.need) or self.shown.setdefault(w.need, fmt_gib(w.need)))
        else:
            key = ("small", w.product, w.text) if w.kind in ("small", "policy") else (w.kind,)
        g = self.groups.get(key)
        if g is None:
            self.groups[key] = _Group(count, w, w, w.free, {w.product})
            return
        g.count += count
        g.most = max(g.most, w.free)
        g.products.add(w.product)
        if (-w.free, w.node) < (-g.best.free, g.best.node):
            g.best = w

    def lines(self, excluded: int, req: Request, s: Settings, ledger: Ledger) -> list[str]:
        many = len(set(self.shown.values())) > 1
        out = []
        for key, g in self.groups.items():
            best = g.best
            if key[0] == "memory" and not best.gpus:  # the best candidate, with its GPUs
                best = replace(best, gpus=_best_group(ledger, best.node, best.product, s.gpus))
            out.append(f"{g.count} {_group_text(str(key[0]), g, best, s, many)}{_learned_text(req, s, g.products)}")
        if excluded:
            out.append(f"{excluded} node(s) didn't match {_selector_words(req)}")
        return sorted(out)


def _learned_text(req: Request, s: Settings, products: Iterable[str]) -> str:
    """The learned over-run a refused need includes, and who taught it: a refusal states its figure."""
    hits = sorted({h for p in products if (h := memory.learned.correction(req.model.name, p, s)) is not None})
    return "".join(f" (of it {fmt_gib(extra)} learned at a start: {source})" for extra, source in hits)


def _group_text(kind: str, g: _Group, best: _Why, s: Settings, name_product: bool) -> str:
    n = s.gpus
    if kind == "nogpu":
        return "node(s) had no GPUs"
    if kind == "few":
        return f"node(s) had fewer than {n} GPUs of one type (at most {g.most})"
    first = g.first
    if first.kind == "policy":
        return f"node(s) refused by their {first.text}"
    if kind == "small":
        return f"node(s) with {first.product}: {first.text}"
    least = "at least " if _shrinkable(s) else ""
    on = "/".join(sorted(g.products)) + ": " if name_product else ""
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
    types = sorted({sl.gpu for sl in node.gpus if n == 1 or not sl.mig}, key=BY_PRODUCT)
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
            ((ledger.heads[(name, sl.index)], sl.index) for sl in node.gpus if sl.gpu == t),
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
        ((ledger.heads[(node, sl.index)], sl.index) for sl in ledger.nodes[node].gpus
         if sl.gpu.product == product and (n == 1 or not sl.mig)),
        key=lambda e: (-e[0], e[1]),
    )
    return tuple(sorted(i for _, i in heads[:n]))


def _indexed_causes(ledger: Ledger, req: Request, s: Settings, matching: NodeSet | None, groups: _Groups) -> None:
    """`_node_cause` for every node `matching` allows (None: all), counted into `groups` without
    visiting the nodes: the node set's summary (core.placement.summary, kept until a node changes)
    counts the nodes of one GPU type by type and GPU count, whose cause depends only on those; their
    best candidate is the top of the ledger's headroom index of that type; nodes with several types
    are answered node by node. The same rules: memory (least missing, the first type by product on
    ties) before too few GPUs (the most of one type) before a type the model never runs on."""
    n = s.gpus
    nodes = summary.nodes_of_set(ledger, matching, n)
    for text, count in nodes.errors.items():
        groups.add(_Why("policy", text=text), count)
    if nodes.nogpu:
        groups.add(_Why("nogpu"), nodes.nogpu)
    for name in nodes.mixed:
        groups.add(_node_cause(ledger, req, s, name))
    for t, per_count in sorted(nodes.single.items(), key=lambda e: e[0].product):
        full = _full_sizing(req.model, s, t)
        need = _min_need(req.model, s, t)
        if isinstance(full, str) or need is None or not full.fits:
            text = full if isinstance(full, str) else "; ".join(full.reasons)
            groups.add(_Why("small", t.product, text=text), sum(per_count.values()))
            continue
        for have, count in sorted(per_count.items()):
            if have < n:
                groups.add(_Why("few", t.product, free=have), count)
        placeable = sum(count for have, count in per_count.items() if have >= n)
        if placeable:
            groups.add(_top(ledger, t, n, need, nodes), placeable)


def _top(ledger: Ledger, t: GpuType, n: int, need: int, nodes: summary.NodesOfSet) -> _Why:
    """The memory cause of the single-type node of type t with the most room for a group of n
    (ties: the first node by name, then the lowest GPU index), read from the top of the index."""
    entries = ledger.free_index(t) if n == 1 else ledger.group_index(t, n)
    e = next(entries.walk(-_UNLIMITED, True, nodes.only), None)  # the most room, then the first node, GPU
    if e is None:  # unreachable: a node counted with n GPUs of type t is in its index
        raise AssertionError(f"no {t.product} node in the index")
    top = e[0]
    return _Why("memory", t.product, need, top, e[1], (e[2],) if n == 1 else (), missing=need - top)


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
