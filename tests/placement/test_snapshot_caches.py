"""A committed snapshot shares nothing that the writer walks while another thread inserts into it.

The writer's ledger and its snapshots share the selection cache of one node state (the matches
of each nodeSelector and required affinity, the per-set summaries a refusal counts). A review
thread deciding on the snapshot inserts into it; the writer, when a node joins, changes or
leaves, walks it to carry the matches over (census.still_matching). The interleaving is forced at
a named point, not left to a sleep: the writer stops while it looks at its first cached entry
(`affinity.selected` or `Ledger.node_set`, called by still_matching), a review thread decides on the snapshot with a
selector never seen before, and only then does the writer go on. Every node change must finish,
the ledger it leaves must equal one rebuilt from its nodes, and the cache stays bounded however
many unique selectors the reviews bring.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from placement_fakes import H100, node, request

from vllmfit.core import limits, placement
from vllmfit.core.placement import affinity, census


def _fleet(n: int = 4) -> placement.Ledger:
    return placement.Ledger([node(f"n{i}", H100, 8, {"pool": "x" if i % 2 else "y", "id": str(i)})
                             for i in range(n)])


def _review(snap: placement.Ledger, selector: dict[str, str]) -> placement.Decision:
    return placement.decide(snap, request("t/r", placement={"nodeSelector": selector}))


def _at_first_walk(monkeypatch: pytest.MonkeyPatch, then: Callable[[], Any]) -> list[int]:
    """At the writer's first look at a cached selection (census.still_matching -> affinity.selected
    for a node that is there, Ledger.node_set for a set that lost it; on the main thread), run
    `then` in a thread to its end, then let the writer go on."""
    fired: list[int] = []

    def stopping(real: Callable[..., Any]) -> Callable[..., Any]:
        def at_point(*args: Any, **kwargs: Any) -> Any:
            if not fired and threading.current_thread() is threading.main_thread():
                fired.append(1)
                t = threading.Thread(target=then)
                t.start()
                t.join()
            return real(*args, **kwargs)
        return at_point

    monkeypatch.setattr(census.affinity, "selected", stopping(affinity.selected))
    monkeypatch.setattr(placement.Ledger, "node_set", stopping(placement.Ledger.node_set))
    return fired


def _walk(ledger: placement.Ledger, selector: dict[str, str]) -> tuple[str, ...]:
    return tuple(sorted(n for n, nd in ledger.nodes.items() if all(nd.labels.get(k) == v for k, v in selector.items())))


@pytest.mark.parametrize("change", ["join", "relabel", "remove"])
def test_a_node_change_while_a_review_thread_selects_on_the_snapshot(monkeypatch: pytest.MonkeyPatch,
                                                                     change: str) -> None:
    ledger = _fleet()
    for sel in ({"pool": "x"}, {"pool": "y"}):  # cached selections the writer walks when a node changes
        assert ledger.matching(sel) is not None
    snap = ledger.snapshot()
    answers: list[placement.Decision] = []
    fired = _at_first_walk(monkeypatch, lambda: answers.append(_review(snap, {"id": "new-selector"})))
    if change == "join":
        ledger.set_node(node("n9", H100, 8, {"pool": "x", "id": "9"}))
    elif change == "relabel":
        ledger.set_node(node("n1", H100, 8, {"pool": "y", "id": "1"}))
    else:
        ledger.remove_node("n1")
    assert fired and answers and not answers[0].admitted  # the review ran inside the writer's walk
    rebuilt = placement.Ledger(ledger.nodes.values())
    for sel in ({"pool": "x"}, {"pool": "y"}, {"id": "new-selector"}):
        found = ledger.matching(sel)
        assert found is not None and found.names == rebuilt.matching(sel).names == _walk(ledger, sel)
    for t in ledger.gpu_types():  # every GPU of every node indexed: each node stays placeable
        assert sorted((e[1], e[2]) for e in ledger.free_index(t).below(1 << 62)) == sorted(
            (e[1], e[2]) for e in rebuilt.free_index(t).below(1 << 62))
    assert ledger.census.classes == rebuilt.census.classes and ledger.census.sizes == rebuilt.census.sizes
    # the snapshot kept what it saw
    assert sorted(snap.nodes) == ["n0", "n1", "n2", "n3"] and snap.matching({"pool": "x"}).names == ("n1", "n3")


def test_unique_selectors_keep_the_selection_cache_bounded() -> None:
    ledger = _fleet(3)
    snap = ledger.snapshot()
    for i in range(limits.MAX_SELECTIONS * 3):  # dry-run reviews, each with an affinity never seen before
        _review(snap, {"id": f"u{i}"})
    assert len(snap.selections) <= limits.MAX_SELECTIONS
    before = ledger.selections
    ledger.set_node(node("n7", H100, 8, {"pool": "x", "id": "7"}))
    assert ledger.selections is not before and len(ledger.selections) <= limits.MAX_SELECTIONS_KEPT
    assert ledger.matching({"id": "u0"}).names == ()  # dropped, computed again on demand
    assert ledger.matching({"pool": "x"}).names == ("n1", "n7")


def test_the_least_recently_used_selection_goes_first() -> None:
    cache = census.Selections(limit=2)
    cache.put(("a",), 1)
    cache.put(("b",), 2)
    assert cache.get(("a",)) == 1  # "a" used last: "b" goes when a third comes
    cache.put(("c",), 3)
    assert cache.get(("b",)) is None and cache.get(("a",)) == 1 and cache.get(("c",)) == 3
    assert [k for k, _ in cache.recent(1)] == [("c",)]
