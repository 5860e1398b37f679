"""One decision path over snapshots (issue 29): a review decides on the committed snapshot, never
on the ledger the operator writes, and the status writer, the resync and every other reader see
only what a critical section committed.

The race is replayed on a fixed schedule, not with sleeps: the review's decision is held inside
`placement.decide` (a threading.Event, in the worker thread) while the event loop runs the status
writer and a resync; then it is let go. On the code before issue 29 this reproduced the reported
double booking: the review released A's bookings on the live ledger to decide its update, the
status writer wrote `phase: Admitted, memory: []` for A meanwhile, the resync restored nothing for
A, and B was admitted onto A's GPU (over its budget).
"""

from __future__ import annotations

import asyncio
import importlib
import threading
from typing import Any, ClassVar

import kubernetes_asyncio.client
import pytest
from opkit import node, vd

from vllmfit.core import defaults, placement
from vllmfit.operator.admission import webhook
from vllmfit.operator.booking import state
from vllmfit.operator.booking.books import Stale
from vllmfit.operator.handlers.common import Effects, parse
from vllmfit.operator.handlers.decide import apply_decision
from vllmfit.sources import catalog

GIB = 2**30
decide_module = importlib.import_module("vllmfit.core.placement.decide")  # the package exports the function


class StatusApi:
    """kubernetes_asyncio.client.CustomObjectsApi, recording the status patches it is sent."""

    sent: ClassVar[list[tuple[str, dict[str, Any]]]] = []

    def __init__(self, api: Any = None) -> None:
        pass

    async def patch_namespaced_custom_object_status(self, group, version, ns, plural, name, body, **_: Any):
        StatusApi.sent.append((f"{ns}/{name}", body["status"]))
        return Answer()


class Answer:
    """The client's raw answer (the status writer asks for it unread: _preload_content=False)."""

    status = 200

    async def read(self) -> bytes:
        return b"{}"


def admitted_store(bodies: list[dict[str, Any]]) -> state.Store:
    """A Store with one H100 and these deployments admitted by the operator's own path."""
    store = state.Store()
    store.books.ledger = placement.Ledger([placement.node_from_object(node("gpu-a", 1), catalog.gpu_for_label)])
    for body in bodies:
        rec = store.cache.upsert(body)
        req = placement.request_from_object(parse(body), catalog.model(body["spec"]["model"]))
        d = placement.decide(store.books.ledger, req)
        assert d.admitted, d.message
        with store.books.step():
            apply_decision(store, rec, req, d, Effects())
    store.leading = True
    store.books.publish()
    store.books.ready.set()
    return store


@pytest.fixture
def held_decision(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event, threading.Event]:
    """(armed, inside, go): once `armed`, the next decision signals `inside` once it is placing
    (its own bookings set aside), then waits for `go`."""
    armed, inside, go = threading.Event(), threading.Event(), threading.Event()
    real = decide_module._decide

    def held(*args: Any, **kwargs: Any) -> Any:
        if armed.is_set():
            inside.set()
            assert go.wait(30), "the test never let the decision go"
        return real(*args, **kwargs)

    monkeypatch.setattr(decide_module, "_decide", held)
    # reviews decide on a thread, so a decision can be held while the loop runs the writer (a quick
    # decision on the event loop, issue 32, cannot interleave with anything)
    monkeypatch.setattr(defaults, "REVIEW_INLINE_REPLICAS", 0)
    monkeypatch.setattr(kubernetes_asyncio.client, "CustomObjectsApi", StatusApi)
    StatusApi.sent = []
    return armed, inside, go


async def test_a_dry_run_update_review_never_shows_a_half_changed_ledger(held_decision):
    armed, inside, go = held_decision
    a = vd("a", maxModelLen=8192, kvCache={"memory": "40Gi"})
    store = admitted_store([a])
    armed.set()
    booked = store.books.ledger.bookings_of("default/a")
    assert booked and store.cache.records["default/a"].admitted
    store.cache.records["default/a"].written = {}  # its status is still to be written

    loop = asyncio.get_running_loop()
    changed = {**a, "spec": {**a["spec"], "maxModelLen": 4096}}
    review = asyncio.create_task(webhook.review(store, changed, a, "UPDATE", True))
    assert await loop.run_in_executor(None, inside.wait, 30)  # the review is deciding, A set aside
    try:
        await store.writer._patch_status("default/a")  # the status writer, meanwhile
        written = dict(StatusApi.sent)["default/a"]
        assert written["phase"] == "Admitted"
        assert [(m["node"], m["index"]) for m in written["memory"]] == [(b.node, b.index) for b in booked]
        # a resync meanwhile reads back what was written (nodes and statuses as listed)
        listed = {**a, "status": written}
        async with store.books.transaction(counted=False):
            store.resync([node("gpu-a", 1)], [listed])
    finally:
        go.set()
    verdict = await review
    assert verdict.allowed

    assert written["phase"] == "Admitted"
    assert [(m["node"], m["index"]) for m in written["memory"]] == [(b.node, b.index) for b in booked]
    def held(bs: list[placement.Booking]) -> list[tuple[str, int, int]]:
        return [(b.node, b.index, b.footprint.total) for b in bs]

    assert held(store.books.ledger.bookings_of("default/a")) == held(booked)  # the resync restored A

    # B fits an empty H100 but not beside A: it must be refused, never booked over A
    b = vd("b", maxModelLen=8192, kvCache={"memory": "40Gi"})
    req = placement.request_from_object(parse(b), catalog.model(b["spec"]["model"]))
    d = placement.decide(store.books.snapshot(), req)
    assert not d.admitted, f"B admitted onto A's GPU: {d.message}"
    assert store.books.ledger.over_budget() == []


async def test_readers_see_the_committed_snapshot_while_a_critical_section_is_open():
    """Inside the lock the writer changes the ledger (and awaits); readers outside it see the
    version the last critical section committed, and the next one once the lock is released."""
    a = vd("a", maxModelLen=8192, kvCache={"memory": "40Gi"})
    store = admitted_store([a])
    before, version = store.books.snapshot(), store.books.version
    async with store.books.changing():
        store.books.ledger.release("default/a")
        await asyncio.sleep(0)  # a reader may run here
        assert store.books.snapshot() is before and store.books.snapshot().bookings_of("default/a")
    assert store.books.version == version + 1 and store.books.snapshot().bookings_of("default/a") == []
    assert before.bookings_of("default/a")  # a snapshot never changes


def test_a_snapshot_is_frozen_and_a_fork_changes_only_itself():
    nodes = [placement.node_from_object(node(f"gpu-{i}", 2), catalog.gpu_for_label) for i in range(3)]
    led = placement.Ledger(nodes)
    reqs = [placement.request_from_object(parse(vd(n, maxModelLen=8192, kvCache={"memory": "20Gi"})),
                                          catalog.model("Qwen/Qwen2.5-7B-Instruct")) for n in "abc"]
    for r in reqs[:2]:
        led.book(placement.decide(led, r))
    snap = led.snapshot()
    seen = {(s.node, s.index): snap.headroom_bytes(s.node, s.index) for s in snap.slots()}
    fork = snap.fork()
    fork.book(placement.decide(fork, reqs[2]))
    led.release("default/a")
    led.set_node(placement.node_from_object(node("gpu-9", 1), catalog.gpu_for_label))
    assert {(s.node, s.index): snap.headroom_bytes(s.node, s.index) for s in snap.slots()} == seen
    assert snap.deployments() == ["default/a", "default/b"]
    assert fork.deployments() == ["default/a", "default/b", "default/c"]
    assert led.deployments() == ["default/b"] and "gpu-9" in led.nodes and "gpu-9" not in snap.nodes
    with pytest.raises(TypeError, match="never changes"):
        snap.release("default/b")
    # decide on a snapshot leaves it as it was, even for a deployment it holds (an update)
    d = placement.decide(snap, reqs[0])
    assert d.admitted and snap.bookings_of("default/a")
    assert {(s.node, s.index): snap.headroom_bytes(s.node, s.index) for s in snap.slots()} == seen


async def test_the_one_writer_commits_only_what_was_decided_on_the_current_version():
    """Store.commit / Store.apply (the writer's API, docs/operator.md): a decision taken on an
    older snapshot is refused as Stale, and nothing changes; decided again, it commits."""
    a = vd("a", maxModelLen=8192, kvCache={"memory": "10Gi"})
    store = admitted_store([a])
    b = vd("b", maxModelLen=8192, kvCache={"memory": "5Gi"})
    req = placement.request_from_object(parse(b), catalog.model(b["spec"]["model"]))
    snap, seen = store.books.snapshot(), store.books.version
    d = placement.decide(snap, req)
    assert d.admitted
    await store.books.apply(lambda ledger: ledger.release("default/a"))  # someone else's change first
    with pytest.raises(Stale):
        await store.books.commit(d, seen)
    assert store.books.snapshot().bookings_of("default/b") == []
    seen = store.books.version
    await store.books.commit(placement.decide(store.books.snapshot(), req), seen)
    assert store.books.snapshot().bookings_of("default/b") and store.books.version == seen + 1
