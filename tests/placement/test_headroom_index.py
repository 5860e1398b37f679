"""The ledger's headroom indices (core/placement/headroom.py, issue 32) are exact: after any
sequence of additions, removals and copies, an `Index` holds what one plain sorted list holds, each
query answers what a walk of that list answers, and a copy never sees the other side's changes.
A new ledger's bulk load (`Ledger._load`) equals one `set_node` per node, and `over_budget`, read
from the indices, equals a walk of every GPU."""

from __future__ import annotations

import bisect

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from placement_fakes import A100_40, H100, L4, check_indices, node

from vllmfit.core import placement
from vllmfit.core.placement.headroom import Index

KEYS = st.sampled_from([-3, 0, 5, 10, 20])  # few distinct headrooms, as a fleet has, and one below zero
NODES = st.sampled_from(["a", "b", "c", "d", "e"])
ENTRY = st.tuples(KEYS, NODES, st.integers(0, 3))
OPS = st.lists(st.one_of(st.tuples(st.just("add"), ENTRY), st.tuples(st.just("remove"), st.integers(0, 99)),
                         st.tuples(st.just("copy"), st.booleans())), max_size=60)


def _plain_first(entries: list, need: int, spread: bool, allowed: frozenset[str] | None) -> object:
    """The first entry a plain walk of the sorted list finds: best fit ascending; spread the most
    headroom, then node and GPU ascending."""
    ok = [e for e in entries if e[0] >= need and (allowed is None or e[1] in allowed)]
    if not ok:
        return None
    if not spread:
        return ok[0]
    top = max(e[0] for e in ok)
    return next(e for e in ok if e[0] == top)


def _check(index: Index, plain: list) -> None:
    assert list(index) == plain and len(index) == len(plain)
    assert index.keys == sorted(index.buckets) and all(index.buckets.values())  # no empty bucket
    assert all(b == sorted(b, reverse=True) for b in index.buckets.values())
    assert index.top() == (plain[-1][0] if plain else None)
    assert index.lowest() == (plain[0] if plain else None)
    assert list(index.below(0)) == [e for e in plain if e[0] < 0]
    for need in (-5, -3, 0, 1, 5, 6, 10, 20, 21):
        assert index.count_from(need) == len(plain) - bisect.bisect_left(plain, (need,))
        for spread in (False, True):
            for allowed in (None, frozenset({"b", "d"}), frozenset({"e"}), frozenset()):
                want = _plain_first(plain, need, spread, allowed)
                assert index.first(need, spread, allowed) == want, (need, spread, allowed)
                walked = list(index.walk(need, spread, None if allowed is None else allowed.__contains__))
                ok = [e for e in plain if e[0] >= need and (allowed is None or e[1] in allowed)]
                assert walked == (sorted(ok, key=lambda e: (-e[0], *e[1:])) if spread else ok)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ENTRY, unique=True, max_size=20), OPS)
def test_an_index_answers_as_a_plain_sorted_list_through_changes_and_copies(start: list, ops: list) -> None:
    index, plain = Index(start), sorted(start)
    others: list[tuple[Index, list]] = []  # copies taken on the way, with what they held then
    _check(index, plain)
    for op, arg in ops:
        if op == "add" and arg not in plain:
            index.add(arg)
            bisect.insort(plain, arg)
        elif op == "remove" and plain:
            e = plain.pop(arg % len(plain))
            index.remove(e)
        elif op == "copy":  # either side goes on changing; the other must stay as it was
            new = index.copy()
            others.append((index, list(plain)) if arg else (new, list(plain)))
            if arg:
                index = new
        _check(index, plain)
        for other, held in others:
            assert list(other) == held
    for other, held in others:
        _check(other, held)


def test_removing_an_entry_the_index_does_not_hold_raises() -> None:
    index = Index([(5, "a", 0), (5, "c", 0), (5, "b", 1)])
    try:
        index.remove((5, "b", 0))
    except KeyError:
        pass
    else:
        raise AssertionError("removed an entry it does not hold")
    assert list(index) == [(5, "a", 0), (5, "b", 1), (5, "c", 0)]


TYPES = (H100, A100_40, L4)
CLUSTER = st.lists(st.tuples(st.sampled_from(range(3)), st.integers(0, 4), st.sampled_from([0, 4 << 30, 90 << 30]),
                             st.sampled_from(["n0", "n1", "n2", "n3"])), max_size=8)


def _nodes(spec: list) -> list[placement.NodeInfo]:
    return [node(name, TYPES[t], count, {}, {0: foreign}) for t, count, foreign, name in spec]


def _state(led: placement.Ledger) -> tuple:
    return (led.version, dict(led.nodes), dict(led._slots), dict(led._used), dict(led.heads),
            {k: list(v) for k, v in led._free.items()}, {k: list(v) for k, v in led._groups.items()},
            {k: dict(v) for k, v in led._group_key.items()}, dict(led._by_type), dict(led._on_gpu),
            (led.census.classes, led.census.sizes, led.census.refusing), led.over_budget())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(CLUSTER)
def test_a_new_ledger_loaded_in_bulk_equals_one_set_node_per_node(spec: list) -> None:
    nodes = _nodes(spec)  # a name may come twice: the later wins, as set_node does
    bulk = placement.Ledger(nodes)
    one_by_one = placement.Ledger()
    one_by_one.version = 0
    for n in nodes:
        one_by_one.set_node(n)
    assert _state(bulk) == _state(one_by_one)
    check_indices(bulk)
    # over budget (foreign use beyond the budget), read from the indices: a walk of every GPU
    assert bulk.over_budget() == [(s.node, s.index) for s in bulk.slots()
                                  if bulk.headroom_bytes(s.node, s.index) < 0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([None, 2048, 4096]), st.sampled_from([0, 16, 32]), st.integers(-2, 2),
                          NODES, st.sampled_from([(0,), (1,), (0, 1)])), min_size=2, max_size=2), st.booleans())
def test_the_search_key_orders_candidates_as_better_does(pair: list, spread: bool) -> None:
    """search._search keeps the best hit per type by `_order`; bulk placement compares with
    `_better`: the two must agree (a is better than b exactly when its key is smaller)."""
    from vllmfit.core.placement import search

    def cand(length: int | None, tokens: int, score: int, name: str, gpus: tuple[int, ...]) -> search._Candidate:
        flags = None if length is None else _FakeFlags(length)
        return search._Candidate(name, gpus, _FakeSizing(flags, tokens), score)  # type: ignore[arg-type]

    a, b = (cand(*p) for p in pair)
    key = [search._order(c.sizing, c.score, c.node, c.gpus, spread) for c in (a, b)]  # type: ignore[arg-type]
    assert search._better(a, b, spread) == (key[0] < key[1])


class _FakeFlags:
    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len


class _FakeSizing:
    def __init__(self, flags: _FakeFlags | None, granted_tokens: int) -> None:
        self.flags, self.granted_tokens = flags, granted_tokens


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.just(5), st.integers(0, 99), st.integers(0, 7)), unique=True, max_size=80))
def test_a_buckets_position_is_the_first_entry_not_above_the_new_one(entries: list) -> None:
    """headroom._position bisects a bucket sorted in descending order: as a plain walk, for
    every entry of the bucket and every place between two."""
    from vllmfit.core.placement.headroom import _position

    b = sorted(entries, reverse=True)
    for e in {(5, x[1], x[2] + d) for x in b for d in (-1, 0, 1)} | {(5, -1, 0), (5, 100, 0)}:
        assert _position(b, e) == next((i for i, x in enumerate(b) if x <= e), len(b)), e
