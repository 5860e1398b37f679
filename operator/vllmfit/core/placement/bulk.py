"""Bulk placement: the next k replicas of one deployment, all with the same settings, placed where
the replica-by-replica search (`search._search`, then a booking, then the next search) would put
them, without booking each one to search for the next.

Why it is the same result (docs/placement.md, "Many identical replicas"): with fixed settings a
replica needs the same bytes on every GPU of a type, so each search picks, per GPU type, the best
entry of that type's index (best fit: the least headroom that still fits, then node, then GPU;
spread: the most), and the best of those across types (`search._better`). Placing a replica only
lowers the headroom of the entry it took. So the entries never taken keep their place in the
ledger's sorted index and are read from it in order (a cursor, never a scan); the entries taken
go to a small heap with their new headroom. Each step compares the two heads per type, exactly
as a fresh search over the updated index would. Work: O(k log k) plus the index entries passed
over, instead of k searches and k index updates. tests/test_bulk_placement.py checks it against
the replica-by-replica search on random clusters (hypothesis)."""

from __future__ import annotations

import heapq
from typing import Any

from vllmfit.core.memory import Settings, Sizing
from vllmfit.core.model.facts import GpuType
from vllmfit.core.placement.headroom import Index
from vllmfit.core.placement.inputs import Request
from vllmfit.core.placement.ledger import Ledger, NodeSet
from vllmfit.core.placement.search import (
    _FEW_NODES,
    _better,
    _Candidate,
    _full_sizing,
    _is_mig_type,
    _shrinkable,
    keep_room,
)


def applies(s: Settings) -> bool:
    """Whether every replica placed with `s` needs the same bytes per GPU type: no KV cache that
    grows into the room found, no value lowered to fit it (replica 0 fixes them for the others)."""
    return not s.kv_grow and not _shrinkable(s)


def place(
    ledger: Ledger, req: Request, s: Settings, nodes: NodeSet | None, spread: bool, count: int
) -> list[_Candidate]:
    """Up to `count` candidates, in replica order, as `count` rounds of search + booking would
    choose them; fewer when the next replica fits nowhere. The ledger is not changed. Only for
    settings where `applies(s)`."""
    streams = [st for t in (ledger.gpu_types() if nodes is None else nodes.types)
               if (st := _Stream.of(ledger, req, s, t, nodes, spread)) is not None]
    out: list[_Candidate] = []
    current: list[_Candidate | None] = [st.peek() for st in streams]
    while len(out) < count:
        best, at = None, -1
        for i, c in enumerate(current):
            if c is not None and (best is None or _better(c, best, spread)):
                best, at = c, i
        if best is None:
            break
        out.append(best)
        streams[at].take(best)
        current[at] = streams[at].peek()
    return out


class _Stream:
    """The candidates of one GPU type, best first, with the headroom of the entries taken so far."""

    def __init__(self, ledger: Ledger, t: GpuType, n: int, sizing: Sizing, entries: Index,
                 allowed: frozenset[str] | None, spread: bool) -> None:
        self.ledger, self.t, self.n, self.sizing, self.spread = ledger, t, n, sizing, spread
        self.need = sizing.footprint.total
        self.nodes: dict[str, list[tuple[int, int]]] = {}  # n > 1: the nodes read or changed so far
        self.taken: list[tuple[Any, ...]] = []  # heap of (order key, entry) of entries taken, still fitting
        self.fresh = entries.walk(self.need, spread, None if allowed is None else allowed.__contains__)
        self.next_fresh = next(self.fresh, None)
        self.cached: _Candidate | None = None
        self.cached_entry: tuple[Any, ...] | None = None
        self.cached_whole = False  # the cached candidate takes every GPU of the type on its node
        # n == 1: the GPU on the entry's node is search.keep_room's choice, maybe not the entry's own
        # GPU; the GPUs taken so far have their headroom here, their index entries are skipped
        self.keep = n == 1 and not spread and not _is_mig_type(ledger, t)
        self.moved: dict[tuple[str, int], int] = {}

    @classmethod
    def of(cls, ledger: Ledger, req: Request, s: Settings, t: GpuType, nodes: NodeSet | None,
           spread: bool) -> _Stream | None:
        n = s.gpus
        if n > 1 and _is_mig_type(ledger, t):
            return None
        full = _full_sizing(req.model, s, t)
        if isinstance(full, str) or not full.fits:
            return None
        few = nodes is not None and len(nodes.names) <= _FEW_NODES
        allowed = None if nodes is None or few else nodes.members
        entries: Index
        if n == 1:
            entries = Index((ledger.heads[(nd, sl.index)], nd, sl.index) for nd in nodes.names
                             for sl in ledger.nodes[nd].gpus if sl.gpu == t and (nd, sl.index) in ledger.heads) \
                if few and nodes is not None else ledger.free_index(t)
        else:
            entries = Index((k, nd) for nd in nodes.names if (k := ledger.node_group_key(nd, t, n)) is not None) \
                if few and nodes is not None else ledger.group_index(t, n)
        return cls(ledger, t, n, full, entries, allowed, spread)

    def _order(self, entry: tuple[Any, ...]) -> tuple[Any, ...]:
        return (-entry[0], *entry[1:]) if self.spread else entry

    def _head_entry(self) -> tuple[Any, ...] | None:
        """The best entry: the best untaken one from the index or the best taken one."""
        if self.n == 1 and self.moved:  # skip the index entries of GPUs taken, and stale heap entries
            moved = self.moved
            while self.next_fresh is not None and (self.next_fresh[1], self.next_fresh[2]) in moved:
                self.next_fresh = next(self.fresh, None)
            while self.taken and moved[(e := self.taken[0][1])[1], e[2]] != e[0]:
                heapq.heappop(self.taken)
        fresh, taken = self.next_fresh, self.taken[0][1] if self.taken else None
        if fresh is None or (taken is not None and self._order(taken) < self._order(fresh)):
            return taken
        return fresh

    def peek(self) -> _Candidate | None:
        entry = self._head_entry()
        if entry is None:
            return None
        if entry is not self.cached_entry:
            node = entry[1]
            whole = self.n > 1 and len(of_type := self.ledger.type_indices(node, self.t)) == self.n
            if self.n == 1:
                gpus: tuple[int, ...] = (entry[2],)
                if self.keep:  # search._keeping, on the headroom the replicas taken left
                    budget = self.ledger.slot(node, entry[2]).budget_bytes
                    gpus = (keep_room(self._node(node), self.need, budget, (entry[0], entry[2]),
                                      self.sizing.footprint.overhead),)
            elif whole:
                gpus = tuple(sorted(of_type))  # all of them: the key, the least room of the n, fits
            else:  # search._pick: the n GPUs of the node that fit with the least (spread: most) room
                fit = sorted((h, i) for h, i in self._node(node) if h >= self.need)
                chosen = sorted(fit, key=lambda e: (-e[0], e[1]))[: self.n] if self.spread else fit[: self.n]
                gpus = tuple(sorted(i for _, i in chosen))
            self.cached = _Candidate(node, gpus, self.sizing, entry[0] - self.need)
            self.cached_entry, self.cached_whole = entry, whole
        return self.cached

    def _node(self, node: str) -> list[tuple[int, int]]:
        """[(headroom, index)] of the node's GPUs of this type, as the replicas taken left them."""
        found = self.nodes.get(node)
        if found is None:
            head = self.ledger.heads
            found = self.nodes[node] = [(head[(node, i)], i) for i in self.ledger.type_indices(node, self.t)]
        return found

    def take(self, c: _Candidate) -> None:
        """Book `c` here: lower its GPUs' headroom and put its entry back with its new key."""
        entry = self.cached_entry
        assert entry is not None and c is self.cached
        if self.n > 1:
            if self.taken and self.taken[0][1] is entry:
                heapq.heappop(self.taken)
            else:
                self.next_fresh = next(self.fresh, None)
        new: tuple[Any, ...]
        if self.n == 1:  # the GPU taken (keep_room's, maybe not the entry's) lowered; its old entries skipped
            g = c.gpus[0]
            at = (c.node, g)
            key = (self.moved[at] if at in self.moved else self.ledger.heads[at]) - self.need
            self.moved[at] = key
            self.nodes[c.node] = [(h - self.need if i == g else h, i) for h, i in self._node(c.node)]
            new = (key, c.node, g)
            if key >= self.need:
                heapq.heappush(self.taken, (self._order(new), new))
            self.cached_entry = self.cached = None
            return
        if self.cached_whole:  # the node's n GPUs of the type, each lowered by need: the least of them too
            key = entry[0] - self.need
            new = (key, c.node)
        else:  # Ledger.node_group_key: the n-th largest headroom of the node's GPUs of the type
            heads = self.nodes[c.node] = [(h - self.need if i in c.gpus else h, i) for h, i in self._node(c.node)]
            key = sorted((h for h, _ in heads), reverse=True)[self.n - 1]
            new = (key, c.node)
        if key >= self.need:
            heapq.heappush(self.taken, (self._order(new), new))
        self.cached_entry = self.cached = None
