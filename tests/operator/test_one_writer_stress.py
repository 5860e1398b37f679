"""Everything that touches the ledger at once, on a fixed schedule: reviews with unique selectors
on review threads, node joins, label changes and removals, reconciles that book and release,
and scrapes from the metrics thread, for fixed seeds.

The interleavings are forced at named points, not left to sleeps:
- `review-insert`: a review thread stops just before it adds a selection to the snapshot's cache
  (census.Selections.put); the loop changes a node meanwhile; then the review goes on;
- `writer-walk`: the loop stops while it carries the cached selections over to a node's new state
  (census.still_matching asks affinity.selected); a review thread runs to its end meanwhile;
- `scrape`: a scrape on its own thread while the loop is free to copy what it reads.
After every step: no exception anywhere; the committed snapshot equals a ledger rebuilt from
scratch from its nodes and bookings (the census, every GPU's use and headroom, the free and group
indices, every cached selection); the census equals a walk of the nodes; every GPU of every node
is in the free index (placeable).
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
from opkit import node
from prometheus_client.core import Metric

from vllmfit.core import placement
from vllmfit.core.placement import OverBudget, affinity, census
from vllmfit.core.spec.api import VLLMDeploymentSpec
from vllmfit.operator import metrics
from vllmfit.operator.booking.books import Stale
from vllmfit.operator.booking.state import Store
from vllmfit.sources import catalog

MODEL = catalog.model("Qwen/Qwen2.5-0.5B-Instruct")
POOLS = ("x", "y", "z")


def _info(name: str, gpus: int, pool: str) -> placement.NodeInfo:
    body = node(name, gpus)
    body["metadata"]["labels"].update({"pool": pool, "id": name})
    return placement.node_from_object(body, catalog.gpu_for_label)


def _request(key: str, selector: dict[str, str] | None = None, unique: str | None = None) -> placement.Request:
    spec: dict[str, Any] = {"model": MODEL.name, "kvCache": {"concurrency": 1}}
    if selector:
        spec["placement"] = {"nodeSelector": selector}
    if unique:  # a required node affinity never seen before (every node but none matches it)
        spec["podTemplate"] = {"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "id", "operator": "NotIn", "values": [unique]}]}]}}}}}
    return placement.Request(key, VLLMDeploymentSpec.model_validate(spec), MODEL, ("", key))


class Points:
    """The named points: a callable run there once, from the thread named."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed: dict[str, tuple[Callable[[], None], bool]] = {}  # point -> (run, on the main thread?)
        self.reached: dict[str, int] = {}
        real_put, real_selected = census.Selections.put, affinity.selected

        def put(cache: census.Selections, key: Any, value: Any) -> Any:
            self.hit("review-insert", main=False)
            return real_put(cache, key, value)

        def selected(*args: Any, **kwargs: Any) -> bool:
            self.hit("writer-walk", main=True)
            return real_selected(*args, **kwargs)

        monkeypatch.setattr(census.Selections, "put", put)
        monkeypatch.setattr(census.affinity, "selected", selected)

    def arm(self, point: str, run: Callable[[], None], *, main: bool) -> None:
        self.armed[point] = (run, main)

    def hit(self, point: str, *, main: bool) -> None:
        found = self.armed.get(point)
        if found is not None and found[1] == main and (threading.current_thread() is threading.main_thread()) == main:
            del self.armed[point]
            self.reached[point] = self.reached.get(point, 0) + 1
            found[0]()


def _rebuilt(snap: placement.Ledger) -> placement.Ledger:
    fresh = placement.Ledger(list(snap.nodes.values()), kv_grant=snap.kv_grant)
    for key in snap.deployments():
        fresh.restore(key, snap.bookings_of(key))
    return fresh


def _check(snap: placement.Ledger, selectors: list[dict[str, str]]) -> None:
    fresh = _rebuilt(snap)
    assert snap.census.classes == fresh.census.classes and snap.census.sizes == fresh.census.sizes
    walk = placement.Ledger(list(snap.nodes.values())).census  # a walk of the nodes alone
    assert snap.census.classes == walk.classes and dict(snap.census.refusing) == dict(walk.refusing)
    assert snap.slots() == fresh.slots()
    for s in snap.slots():
        assert (snap.used_bytes(s.node, s.index), snap.headroom_bytes(s.node, s.index)) == (
            fresh.used_bytes(s.node, s.index), fresh.headroom_bytes(s.node, s.index))
    assert snap.gpu_types() == fresh.gpu_types()
    indexed = set()
    for t in snap.gpu_types():
        assert sorted(snap.free_index(t)) == sorted(fresh.free_index(t))
        indexed |= {(e[1], e[2]) for e in snap.free_index(t)}
        for n in (1, 2, 4):
            assert sorted(snap.group_index(t, n)) == sorted(fresh.group_index(t, n))
    assert indexed == {(s.node, s.index) for s in snap.slots()}  # every GPU of every node placeable
    for sel in selectors:
        found = snap.matching(sel)
        names = tuple(sorted(n for n, nd in snap.nodes.items() if all(nd.labels.get(k) == v for k, v in sel.items())))
        assert found is not None and found.names == names == fresh.matching(sel).names


def _gauge(families: list[Metric], name: str) -> float:
    return sum(s.value for f in families if f.name == name for s in f.samples)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_reviews_node_changes_reconciles_and_scrapes_together(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    rnd = random.Random(seed)
    store = Store()
    store.rebuild([], [])
    with store.books.step() as ledger:
        for i in range(6):
            ledger.set_node(_info(f"n{i}", rnd.choice((1, 2, 4)), rnd.choice(POOLS)))
    points, errors, uniques = Points(monkeypatch), [], iter(range(10**6))
    selectors = [{"pool": p} for p in POOLS]
    collector = metrics.register(store)

    def review(snap: placement.Ledger) -> None:
        try:
            placement.decide(snap, _request(f"t/r{next(uniques)}", unique=f"u{next(uniques)}"))
            placement.decide(snap, _request("t/s", selector=rnd.choice(selectors)))
        except Exception as e:  # noqa: BLE001 - recorded: no exception anywhere
            errors.append(e)

    def on_thread(snap: placement.Ledger) -> threading.Thread:
        t = threading.Thread(target=review, args=(snap,))
        t.start()
        return t

    def node_change() -> None:
        with store.books.step() as ledger:
            what, name = rnd.choice(("join", "relabel", "remove")), f"n{rnd.randrange(9)}"
            if what == "remove":
                if name in ledger.nodes and len(ledger.nodes) > 1:
                    ledger.remove_node(name)
            else:
                ledger.set_node(_info(name, rnd.choice((1, 2, 4)), rnd.choice(POOLS)))

    try:
        for _ in range(40):
            step = rnd.choice(("review-insert", "writer-walk", "reconcile", "release", "scrape", "node"))
            if step == "review-insert":  # the loop changes a node while a review stops before its insert
                at, go_on = threading.Event(), threading.Event()
                points.arm("review-insert", lambda at=at, go_on=go_on: (at.set(), go_on.wait(10)), main=False)
                t = on_thread(store.books.committed)
                if at.wait(10):
                    node_change()
                go_on.set()
                t.join(10)
            elif step == "writer-walk":  # a review runs to its end while the loop walks the cached selections
                snap = store.books.committed
                points.arm("writer-walk", lambda snap=snap: on_thread(snap).join(10), main=True)
                node_change()
                points.armed.pop("writer-walk", None)  # no cached selection to walk: not reached
            elif step in ("reconcile", "release"):
                key = f"ns/d{rnd.randrange(5)}"
                snap, version = store.books.snapshot(), store.books.version
                if step == "reconcile":
                    d = await asyncio.to_thread(placement.decide, snap, _request(key, selector=rnd.choice(selectors)))
                    if d.admitted:
                        try:
                            await store.books.apply(lambda ledger, d=d: ledger.book(d), based_on=version)
                        except (Stale, OverBudget):
                            pass  # decided again by the next reconcile
                else:
                    await store.books.apply(lambda ledger, key=key: ledger.release(key))
            elif step == "scrape":
                families = await asyncio.to_thread(lambda: list(collector.collect()))
                snap = store.books.committed
                assert _gauge(families, "vllmfit_gpu_used_bytes") == sum(snap.used_bytes(s.node, s.index)
                                                                          for s in snap.slots())
            else:
                node_change()
            assert errors == []
            _check(store.books.committed, selectors)
            assert store.books.ledger.version == store.books.committed.version  # nothing changed but through a commit
    finally:
        metrics.unregister(collector)
    assert points.reached.get("review-insert", 0) >= 2 and points.reached.get("writer-walk", 0) >= 2  # the schedule ran
