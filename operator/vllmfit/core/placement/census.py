"""Sets of a ledger's nodes (`NodeSet`), and the ledger's census of its nodes: what a refusal counts that depends only on the nodes, kept as
nodes are added, changed and removed (issue 32), so that no review walks the nodes.

- per class of node, how many: ("single", whole, GPU type, GPUs of it) for a node with one type,
  ("mixed", whole, node) for a node with several, ("error", whole, node, message) for a node with an
  invalid budget policy, ("nogpu", whole) for a node without a GPU; `whole`: MIG slices left out
  (as groups of several GPUs use the node), else counted (NodeInfo.one_type);
- per GPU type, how many nodes have how many whole GPUs of it: the most GPUs of one type a node
  has (the largest group one deployment can use; the largest TP a fix may suggest);
- the nodes that may refuse a pod for a taint, a cordon or no safe GPU binding (`refusing`): the
  only ones whose tolerations a review checks.

Small (a few entries per GPU type, plus one per node that mixes types or has an invalid policy):
the ledger copies it whole when it changes its node table while shared (Ledger._changing).
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from vllmfit.core import limits
from vllmfit.core.model.facts import GpuType
from vllmfit.core.placement import affinity
from vllmfit.core.placement.inputs import NodeInfo

Key = tuple[object, ...]
BY_PRODUCT = attrgetter("product")
"""The sort key of GPU types, their product name (a C call, not a lambda: every search sorts them)."""


@dataclass(frozen=True, eq=False)
class NodeSet:
    """Some nodes of a ledger (a nodeSelector's matches, a pinned node), with their GPU types. A
    cache key on every review: hashed as `members` (a frozenset hashes once), not names each time."""

    names: tuple[str, ...]
    members: frozenset[str]
    types: tuple[GpuType, ...]

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, NodeSet) and self.names == other.names)

    def __hash__(self) -> int:
        return hash(self.members)


class Census:
    __slots__ = ("classes", "refusing", "sizes")

    def __init__(self) -> None:
        self.classes: dict[Key, int] = {}
        self.sizes: dict[GpuType, dict[int, int]] = {}  # type -> GPUs of it on a node -> nodes
        self.refusing: dict[str, None] = {}  # nodes with a taint, a cordon or no safe binding

    def copy(self) -> Census:
        new = Census()
        new.classes, new.refusing = dict(self.classes), dict(self.refusing)
        new.sizes = {t: dict(per) for t, per in self.sizes.items()}
        return new

    def count(self, node: NodeInfo, whole_types: dict[GpuType, list[int]], sign: int) -> None:
        """Count `node` in (sign 1) or out (-1); `whole_types`: its whole GPUs' indices per type."""
        for whole in (False, True):
            one = None if node.error else node.one_type(whole)
            key: Key = (
                ("error", whole, node.name, node.error) if node.error else ("nogpu", whole) if one is None
                else ("mixed", whole, node.name) if one is False else ("single", whole, *one))  # type: ignore[misc]
            _add(self.classes, key, sign)
        for t, ix in whole_types.items():
            _add(self.sizes.setdefault(t, {}), len(ix), sign)
        if node.taints or node.unschedulable or node.unsafe:
            if sign > 0:
                self.refusing[node.name] = None
            else:
                self.refusing.pop(node.name, None)

    def of(self, whole: bool) -> dict[Key, int]:
        """The classes of nodes (module docstring) for groups of whole GPUs or not -> nodes."""
        return {k: n for k, n in self.classes.items() if k[1] is whole}

    def most(self, t: GpuType | None = None) -> int:
        """The most whole GPUs of one type (of type `t` if given) a node has; 0 without any."""
        sizes = self.sizes.values() if t is None else (self.sizes.get(t, {}),)
        return max((max(per) for per in sizes if per), default=0)


def _add(counts: dict, key: object, sign: int) -> None:  # type: ignore[type-arg]
    n = counts.get(key, 0) + sign
    if n:
        counts[key] = n
    else:
        del counts[key]


class Selections:
    """A ledger's selection cache: values computed from its nodes alone (a nodeSelector's /
    required affinity's matches, `Ledger.matching`; the per-set summaries, taints and policy lines
    of core.placement.summary and search), for one state of its nodes. A ledger that changes its
    nodes makes a new one (`still_matching`); one never changes what it holds for a key, so the
    snapshots and scratch copies of one node state may share it, whatever thread they run on.

    Bounded (limits.MAX_SELECTIONS: the keys are what tenants write; the least recently used
    entry goes first) and safe across threads: every read and insert holds its lock, and what
    the writer's loop walks is a copy (`recent`), never the table a review thread inserts into."""

    __slots__ = ("_entries", "_lock", "limit")

    def __init__(self, entries: Iterable[tuple[Key, Any]] = (), limit: int = limits.MAX_SELECTIONS) -> None:
        self._entries: OrderedDict[Key, Any] = OrderedDict(entries)
        self._lock = threading.Lock()
        self.limit = limit

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Key, default: Any = None) -> Any:
        with self._lock:
            found = self._entries.get(key, _MISSING)
            if found is _MISSING:
                return default
            self._entries.move_to_end(key)
            return found

    def put(self, key: Key, value: Any) -> Any:
        """Remember `value` for `key` (the least recently used entry goes past the limit); returns it."""
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.limit:
                self._entries.popitem(last=False)
        return value

    def remembered(self, key: Key, build: Callable[[], Any]) -> Any:
        """The value for `key`, `build()` (outside the lock) and remembered when absent. Two
        threads may both build one; they build the same value, and either is kept."""
        found = self.get(key, _MISSING)
        return self.put(key, build()) if found is _MISSING else found

    def recent(self, n: int) -> list[tuple[Key, Any]]:
        """A copy of the `n` most recently used entries, oldest first."""
        with self._lock:
            return list(itertools.islice(reversed(self._entries.items()), n))[::-1]


_MISSING = object()


def still_matching(cache: Selections, name: str, old: NodeInfo | None, new: NodeInfo | None,
                   node_set: Callable[[Iterable[str]], NodeSet]) -> Selections:
    """A ledger's selection cache after node `name` changed from `old` to `new` (None: absent) in
    what a selection reads (labels, taints, GPUs): a new cache (a snapshot keeps the old one)
    holding the nodeSelector matches / required affinity matches (`Ledger.matching`: keys
    (selector items, terms)) among the limits.MAX_SELECTIONS_KEPT most recently used entries,
    with that one node looked at again, not every node walked (issue 32); the other entries (per-set
    summaries, taints, policies, and the selections used less recently) are dropped: they may count
    the node, and are computed again when asked for. `node_set`: the ledger's, on its node table as
    it is now. Walks a copy (`Selections.recent`): review threads may insert into `cache` meanwhile."""
    out: list[tuple[Key, NodeSet]] = []
    for key, found in cache.recent(limits.MAX_SELECTIONS_KEPT):
        if isinstance(key[0], str) or not isinstance(found, NodeSet):
            continue
        sel, terms = key
        now = new is not None and affinity.selected(name, new.labels, sel, terms)  # type: ignore[arg-type]
        was = name in found.members
        if not now and not was:
            out.append((key, found))
        elif now and was and old is not None and new is not None and _types(old) == _types(new):
            out.append((key, found))  # the same names and GPU types
        elif now and not was and new is not None:
            names = list(found.names)
            bisect.insort(names, name)
            types = sorted(set(found.types) | _types(new), key=BY_PRODUCT)
            out.append((key, NodeSet(tuple(names), found.members | {name}, tuple(types))))
        else:  # left the set, or its GPU types changed: the set's types counted again
            out.append((key, node_set(found.members - {name} if not now else found.members)))
    return Selections(out, cache.limit)


def _types(node: NodeInfo) -> set[GpuType]:
    return {s.gpu for s in node.gpus}
