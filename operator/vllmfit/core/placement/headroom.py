"""The ledger's sorted headroom indices (issue 32): entries `(headroom, node, ...)` in ascending order,
kept as one bucket per distinct headroom.

A fleet has few distinct headroom values per GPU type (every empty GPU of a product has the same
one; bookings come in a few sizes): at 80,000 GPUs and 40,000 deployments, at most about 100 per
type, while one flat sorted list holds 32,000 entries and copies its tail on every insert and
removal. Here the distinct values are a short sorted list of ints, and each value's entries are a
list sorted in *descending* order: the search takes the smallest node name of a value first, and
nodes fill in name order, so an entry leaves (and its node's next entry arrives) at the end of its
bucket, without moving the others. Worst case (every GPU a different headroom) it is a sorted list
of ints plus one-entry buckets: no worse than one flat list.

Copy-on-write: `copy()` shares every bucket; from then on neither side changes a bucket in place,
each copies one first (`own`: the values whose bucket this index copied since).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

Entry = tuple[Any, ...]  # (headroom, node, GPU index) or (group key, node)


class Index:
    """Entries sorted by (headroom, node, ...), in buckets per headroom (module docstring)."""

    __slots__ = ("buckets", "keys", "own", "size")

    def __init__(self, entries: Iterable[Entry] = ()) -> None:
        buckets: dict[int, list[Entry]] = {}
        for e in entries:
            found = buckets.get(e[0])
            if found is None:
                buckets[e[0]] = [e]
            else:
                found.append(e)
        for b in buckets.values():
            b.sort(reverse=True)
        self.keys = sorted(buckets)  # the distinct headroom values, ascending
        self.buckets = buckets  # value -> its entries, descending (the first in order is the last)
        self.size = sum(len(b) for b in buckets.values())
        self.own: set[int] | None = None  # None: every bucket is this index's own (never shared)

    def copy(self) -> Index:
        """A copy sharing every bucket; both copy a bucket before they change it."""
        new = object.__new__(Index)
        new.keys, new.buckets, new.size, new.own = list(self.keys), dict(self.buckets), self.size, set()
        self.own = set()
        return new

    def _bucket(self, key: int) -> list[Entry]:
        b = self.buckets[key]
        if self.own is not None and key not in self.own:
            b = self.buckets[key] = b[:]
            self.own.add(key)
        return b

    def add(self, e: Entry) -> None:
        key = e[0]
        if key not in self.buckets:
            bisect.insort(self.keys, key)
            self.buckets[key] = [e]
            if self.own is not None:
                self.own.add(key)
        else:
            b = self._bucket(key)
            if e < b[-1]:
                b.append(e)
            elif e > b[0]:  # a node after every other of its bucket (names arrive in order too)
                b.insert(0, e)
            else:
                b.insert(_position(b, e), e)
        self.size += 1

    def remove(self, e: Entry) -> None:
        """Remove an entry the index holds."""
        key = e[0]
        b = self._bucket(key)
        if b[-1] == e:
            b.pop()
        elif b[0] == e:
            del b[0]
        else:
            i = _position(b, e)
            if b[i] != e:
                raise KeyError(e)
            del b[i]
        if not b:
            del self.buckets[key]
            del self.keys[bisect.bisect_left(self.keys, key)]
        self.size -= 1

    # reading
    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Entry]:
        for key in self.keys:
            yield from reversed(self.buckets[key])

    def __eq__(self, other: object) -> bool:  # with a list too: the tests compare with a plain walk
        return isinstance(other, Index | list) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def top(self) -> int | None:
        """The largest headroom, None when empty."""
        return self.keys[-1] if self.keys else None

    def lowest(self) -> Entry | None:
        """The first entry, None when empty."""
        return self.buckets[self.keys[0]][-1] if self.keys else None

    def count_from(self, need: int) -> int:
        """How many entries have headroom >= need."""
        keys, buckets = self.keys, self.buckets
        return sum(len(buckets[keys[i]]) for i in range(bisect.bisect_left(keys, need), len(keys)))

    def below(self, limit: int) -> Iterator[Entry]:
        """The entries with headroom < limit, in order."""
        for key in self.keys:
            if key >= limit:
                return
            yield from reversed(self.buckets[key])

    def walk(self, need: int, spread: bool, allowed: Callable[[str], bool] | None = None) -> Iterator[Entry]:
        """The entries with headroom >= need whose node is `allowed` (None: all), best first: best
        fit by headroom ascending; spread by headroom descending; then node, GPU ascending."""
        keys, buckets = self.keys, self.buckets
        lo = bisect.bisect_left(keys, need)
        for i in range(len(keys) - 1, lo - 1, -1) if spread else range(lo, len(keys)):
            b = buckets[keys[i]]
            for j in range(len(b) - 1, -1, -1):
                if allowed is None or allowed(b[j][1]):
                    yield b[j]

    def first(self, need: int, spread: bool, allowed: frozenset[str] | None = None) -> Entry | None:
        """The first entry of `walk` (members of `allowed`, None: all), or None."""
        keys, buckets = self.keys, self.buckets
        lo = bisect.bisect_left(keys, need)
        if lo == len(keys):
            return None
        if allowed is None:
            return buckets[keys[-1] if spread else keys[lo]][-1]
        return next(self.walk(need, spread, allowed.__contains__), None)


def _position(b: list[Entry], e: Entry) -> int:
    """In a list sorted in descending order: the first position whose entry is <= e, by bisection.
    The callers look at both ends first (most entries arrive or leave there); the rest land
    anywhere in their bucket (issue 32's 10k plan: 70 % of them more than 8 from either end), so
    no scan from the ends comes before the bisection."""
    lo, hi = 0, len(b)
    while lo < hi:
        mid = (lo + hi) // 2
        if b[mid] > e:
            lo = mid + 1
        else:
            hi = mid
    return lo
