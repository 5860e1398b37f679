"""The best-fit (or spread) search for one replica's GPU group, over the ledger's indices; sizing
results are cached because they depend only on model, settings, GPU type and room."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from vllmfit.core import defaults, memory
from vllmfit.core.memory import Footprint, Settings, Sizing, SpecError
from vllmfit.core.model.facts import GpuType, ModelArch
from vllmfit.core.placement import affinity
from vllmfit.core.placement.headroom import Index
from vllmfit.core.placement.inputs import NodeInfo, Request, refusal
from vllmfit.core.placement.ledger import Ledger, NodeSet
from vllmfit.core.placement.taints import tolerations_of
from vllmfit.core.spec.api import VLLMDeploymentSpec

# --- Sizing (cached: the result depends only on model, settings, GPU type and `available`) ------

_UNLIMITED = memory.UNLIMITED


@functools.lru_cache(maxsize=8192)
def _full_sizing(model: ModelArch, s: Settings, gpu: GpuType) -> Sizing | str:
    """Sizing with unlimited room: the full-context footprint (or why it can never run)."""
    try:
        return memory.size(model, s, gpu, _UNLIMITED)
    except SpecError as e:
        return str(e)


@functools.lru_cache(maxsize=8192)
def _fitting(model: ModelArch, s: Settings, types: tuple[GpuType, ...]) -> tuple[tuple[GpuType, Sizing], ...]:
    """The types of `types` where the full-context sizing at the KV request fits, with it: what a
    search places first (a grant grows from there), one cache lookup per search instead of one per
    GPU type."""
    s = memory.request_only(s)
    return tuple((t, f) for t in types if not isinstance(f := _full_sizing(model, s, t), str) and f.fits)


def _granted(ledger: Ledger, model: ModelArch, s: Settings, t: GpuType, node: str, gpus: tuple[int, ...],
             request: Sizing) -> Sizing:
    """The sizing on a group where `request` (the KV request alone) fits: the KV cache grows from the
    request towards its limit into the room of the group's tightest GPU (`grant_room`), never below
    the request. docs/memory-model.md, "The KV request"."""
    if not s.kv_grow or not ledger.kv_grant.grants:
        return request
    room = grant_room(ledger, s, node, gpus, request.footprint.total, min(ledger.heads[(node, i)] for i in gpus))
    grown = _sized(model, s, t, room)
    return grown if grown.fits and grown.footprint.kv_cache >= request.footprint.kv_cache else request


def grant_room(ledger: Ledger, s: Settings, node: str, gpus: tuple[int, ...], request: int, room: int) -> int:
    """The bytes per GPU a growing KV cache may take on a group with `room` left: the room; for a
    default grant of rule `requests`, at most a fair share of the GPU's budget (KvGrant.share), and
    never less than its `request` footprint; with `kv_grant.grants` off, the request alone
    (KvGrant.room, on the group's smallest budget)."""
    grant = ledger.kv_grant
    if not grant.grants or s.kv_default is None:
        return grant.room(room, request, 0, False)
    return grant.room(room, request, min(ledger.slot(node, i).budget_bytes for i in gpus), True)


@functools.lru_cache(maxsize=8192)
def _sized(model: ModelArch, s: Settings, gpu: GpuType, available: int) -> Sizing:
    """memory.size, cached: a KV cache that grows into the room of a GPU, or unset values lowered to
    it, depend only on these, and many GPUs have the same room (every empty GPU of a product)."""
    return memory.size(model, s, gpu, available)


@functools.lru_cache(maxsize=8192)
def _min_need(model: ModelArch, s: Settings, gpu: GpuType) -> int | None:
    """The smallest per-GPU footprint this spec can take on this GPU type, for messages: unset
    values at their floor (context MIN_AUTO_MAX_MODEL_LEN, MIN_BATCHED_TOKENS; a default KV grant
    its request)."""
    full = _full_sizing(model, s, gpu)
    if isinstance(full, str):
        return None
    if not _shrinkable(s):
        return full.footprint.total
    low = replace(
        s,
        max_model_len=s.max_model_len or min(defaults.MIN_AUTO_MAX_MODEL_LEN, model.max_model_len),
        max_num_batched_tokens=s.max_num_batched_tokens or memory.MIN_BATCHED_TOKENS,
        **({"kv_grow": False} if s.kv_default else {}),  # type: ignore[arg-type]
    )
    floor = _full_sizing(model, low, gpu)
    return (
        full.footprint.total if isinstance(floor, str) else min(floor.footprint.total, full.footprint.total)
    )


def _shrinkable(s: Settings) -> bool:
    """Whether memory.size may lower unset values to fit the room it is given."""
    return s.gpu_memory_utilization is None and (
        s.max_model_len is None or s.max_num_batched_tokens is None or s.kv_grow
    )


@dataclass(slots=True)  # not frozen: one per search, and a frozen dataclass's __init__ costs a call per field
class _Candidate:
    node: str
    gpus: tuple[int, ...]
    sizing: Sizing
    score: int  # headroom left on the group's key GPU after placing
    footprints: tuple[Footprint, ...] = ()


def _node_matches(node: NodeInfo, spec: VLLMDeploymentSpec, *, taints: bool = True) -> bool:
    """The node matches the spec's nodeSelector and required node affinity and (`taints`) takes
    its pods: not cordoned, every NoSchedule/NoExecute taint tolerated."""
    sel = spec.placement.node_selector or {}
    return affinity.selected(node.name, node.labels, sel.items(), affinity.required_terms(spec)) and not (
        taints and refusal(node, spec))


def schedulable(ledger: Ledger, matching: NodeSet | None, spec: VLLMDeploymentSpec) -> NodeSet | None:
    """`matching` (None: every node) without the nodes that refuse the spec's pods for a taint or
    a cordon; `matching` itself when no node refuses them."""
    if not ledger.census.refusing:  # the nodes that may refuse a pod at all (tainted, cordoned, no safe binding)
        return matching  # none: every node takes the spec's pods, whatever it tolerates
    tol = tolerations_of(spec)
    def build() -> NodeSet:
        names = ledger.nodes if matching is None else matching.names
        barred = {n for n in ledger.census.refusing  # the few nodes that may refuse: no walk of every node
                  if (matching is None or n in matching.members) and ledger.nodes[n].refuses(tol)}
        result = matching if not barred else ledger.node_set(n for n in names if n not in barred)
        return _ALL if result is None else result

    found = ledger.remembered(("taints", tol, matching), build)  # a NodeSet hashes its frozenset, computed once
    return matching if found is _ALL else found  # type: ignore[no-any-return]


_ALL = NodeSet((), frozenset(), ())  # cache marker: every node (matching None) takes the spec's pods


def _pick(
    ledger: Ledger, t: GpuType, n: int, need: int, nodes: NodeSet | None, spread: bool
) -> tuple[str, tuple[int, ...], int] | None:
    """The group of n GPUs of type t with room for `need` bytes each: best fit takes the least
    headroom that still fits (spread the most); ties by node name, then GPU index. Returns
    (node, gpus, key headroom). `nodes` None means every node, else only these."""
    few = nodes is not None and len(nodes.names) <= _FEW_NODES
    allowed = None if nodes is None else nodes.members
    if n == 1:
        if few:
            entries = Index(
                (ledger.heads[(nd, s.index)], nd, s.index)
                for nd in (nodes.names if nodes else ())
                for s in ledger.nodes[nd].gpus
                if s.gpu == t and (nd, s.index) in ledger.heads
            )
            hit = entries.first(need, spread)
        else:
            hit = ledger.free_index(t).first(need, spread, allowed)
        return None if hit is None else (hit[1], (hit[2],), hit[0])
    if few:
        groups = Index(
            (k, nd)
            for nd in (nodes.names if nodes else ())
            if (k := ledger.node_group_key(nd, t, n)) is not None
        )
        top = groups.first(need, spread)
    else:
        top = ledger.group_index(t, n).first(need, spread, allowed)
    if top is None:
        return None
    node = top[1]
    heads = sorted((ledger.heads[(node, i)], i) for i in ledger.type_indices(node, t))
    fit = [(h, i) for h, i in heads if h >= need]
    chosen = sorted(fit, key=lambda e: (-e[0], e[1]))[:n] if spread else fit[:n]
    return node, tuple(sorted(i for _, i in chosen)), top[0]


_FEW_NODES = 16
"""Up to this many candidate nodes, their GPUs are scanned directly instead of the index."""


def keep_room(heads: Iterable[tuple[int, int]], need: int, budget: int, best: tuple[int, int], overhead: int) -> int:
    """The GPU for a one-GPU replica needing `need` on a node whose GPUs of one product have
    `heads` [(headroom, index)], each `budget` bytes, and whose best fit (the least headroom that
    holds the need, then the lowest index) is `best` (headroom, index). docs/placement.md, "Room
    for tensor-parallel groups": best fit where it leaves the GPUs above half of `budget` as they
    are (`best_fit_keeps`: most searches, O(1)). Else the GPU whose placing leaves the node the
    most `room` (a pair's less one process's `overhead`: the replica's own), counted at most as the
    room before less the need (placing `need` may cost that much, no more), ties by best fit.

    One pass, O(GPUs of the node). The room depends only on the two largest headrooms. With two
    GPUs roomier than best fit's, placing there leaves them: the room before, the most any choice
    is counted. With none, no other GPU fits (best fit is the least that does) but one with as
    much room, which leaves the same headrooms. With one, `other`, the choice is between it and
    best fit, from the largest headroom of the rest (`third`)."""
    head, index = best
    if best_fit_keeps(head, need, budget):
        return index
    other, third = None, 0
    for h, i in heads:
        if h > head:
            if other is not None:
                return index
            other = (h, i)
        elif h > third and i != index:
            third = h
    if other is None:
        return index
    cap = room(other[0], head, budget, overhead) - need
    kept = room(other[0], max(head - need, third), budget, overhead)  # best fit's
    left = other[0] - need
    moved = room(max(head, left), max(min(head, left), third), budget, overhead)  # other's
    return other[1] if min(moved, cap) > min(kept, cap) else index


def room(first: int, second: int, budget: int, overhead: int) -> int:
    """The largest deployment a node whose two roomiest GPUs of a product have `first` >= `second`
    bytes free can take, in bytes beyond one process's `overhead`: one GPU, or a tensor-parallel
    pair where each has more than half of `budget` free, less the second process's overhead (a
    pair runs a model one GPU cannot hold, so it needs more than half of each of its GPUs; less
    room serves no pair)."""
    return max(first, 2 * second - overhead) if 2 * second > budget else first


def best_fit_keeps(head: int, need: int, budget: int) -> bool:
    """Whether taking `need` from a GPU with `head` free leaves the GPUs above half of `budget` as
    they are: it stays above half, or was not above it. Then a pair's room stays where it is."""
    return 2 * (head - need) > budget or 2 * head <= budget


def _keeping(ledger: Ledger, t: GpuType, node: str, index: int, head: int, need: int, overhead: int) -> int:
    """`keep_room` on the ledger: the GPU a one-GPU best-fit replica takes on `node`, whose best
    fit is `index` with `head` left, where best fit would not keep the room (_search checks that
    inline, a hot path; MIG slices form no groups: best fit)."""
    heads = ledger.heads
    return keep_room(((heads[(node, i)], i) for i in ledger.type_indices(node, t)), need,
                     ledger.slot(node, index).budget_bytes, (head, index), overhead)


def _search(
    ledger: Ledger, req: Request, s: Settings, nodes: NodeSet | None, spread: bool
) -> _Candidate | None:
    """Best placement of one replica among `nodes` (None: all): a full-context fit anywhere beats
    a reduced context; among full fits, best fit (or spread) by headroom left, then name. On the
    node best fit chose, a one-GPU replica takes `keep_room`'s GPU (its grant grown there)."""
    n = s.gpus
    every = ledger.gpu_types() if nodes is None else nodes.types
    types = tuple(every) if n == 1 else tuple(t for t in every if not _is_mig_type(ledger, t))
    free = n == 1 and nodes is None  # most searches: one GPU, any node
    best: _Candidate | None = None
    model = req.model
    order: tuple[Any, ...] | None = None  # the best hit's _order (smaller is better), its sizing and hit
    for t, full in _fitting(model, s, types):
        if free:  # _pick's answer, inline: the type's first GPU with room (types are the free indices')
            e = ledger.free_index(t).first(full.footprint.total, spread)
            hit = None if e is None else (e[1], (e[2],), e[0])
        else:
            hit = _pick(ledger, t, n, full.footprint.total, nodes, spread)
        if hit:  # best fit by the request; the grant grows from it (a fair share, or the room)
            sized = _granted(ledger, model, s, t, hit[0], hit[1], full) if s.kv_grow else full
            o = _order(sized, hit[2] - sized.footprint.total, hit[0], hit[1], spread)
            if order is None or o < order:
                order, found = o, (sized, hit, t, full)
    if order is not None:
        sized, hit, t, full = found
        if n == 1 and not spread:  # best fit chose the node; on it, the GPU that keeps room (keep_room)
            slot, need = ledger.slot(hit[0], hit[1][0]), full.footprint.total
            if not (2 * (hit[2] - need) > (b := slot.budget_bytes) or 2 * hit[2] <= b or slot.mig):  # best_fit_keeps
                g = _keeping(ledger, t, hit[0], hit[1][0], hit[2], need, full.footprint.overhead)
                if g != hit[1][0]:  # a grant grows on the GPU taken
                    hit = (hit[0], (g,), hit[2])
                    sized = _granted(ledger, model, s, t, hit[0], hit[1], full) if s.kv_grow else full
        return _Candidate(hit[0], hit[1], sized, hit[2] - sized.footprint.total)
    if not _shrinkable(s):
        return None
    for t in types:  # nothing fits as asked: the roomiest group of each type, unset values lowered
        if isinstance(_full_sizing(req.model, s, t), str):
            continue
        hit = _pick(ledger, t, n, -_UNLIMITED, nodes, True)
        if hit is None:
            continue
        sized = _sized(req.model, memory.request_only(s), t, hit[2])  # a lowered context: its request
        if sized.fits:
            c = _Candidate(hit[0], hit[1], sized, hit[2] - sized.footprint.total)
            if best is None or _better(c, best, spread):
                best = c
    return best


def _is_mig_type(ledger: Ledger, t: GpuType) -> bool:
    e = ledger.free_index(t).lowest()
    return e is not None and (sl := ledger.slot(e[1], e[2])) is not None and sl.mig


def _order(sizing: Sizing, score: int, node: str, gpus: tuple[int, ...], spread: bool) -> tuple[Any, ...]:
    """The order of candidates as a key (smaller is better): the longer context (then more KV
    tokens) first; then best fit (least room left) or spread (most); then node name, GPUs."""
    f = sizing.flags
    return (-f.max_model_len, -sizing.granted_tokens, -score if spread else score, node, gpus) if f else \
        (0, 0, -score if spread else score, node, gpus)


def _better(a: _Candidate, b: _Candidate, spread: bool) -> bool:
    """The longer context (then more KV tokens) first; then best fit or spread; then name, GPUs."""
    return _order(a.sizing, a.score, a.node, a.gpus, spread) < _order(b.sizing, b.score, b.node, b.gpus, spread)
