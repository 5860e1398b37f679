"""The periodic resync corrects the ledger to what the cluster says, changing only what differs
(operator/booking/mirror.py, issue 32): after any cluster and any drift of the writer's ledger, a
resync leaves the ledger a fresh rebuild from the same listing gives; an idle resync (nothing
differs) changes nothing, publishes nothing and parses no status; and a drift behind the
operator's back (an event it never got, a write lost, a ledger that forgot a booking) is repaired
by the next resync of a running operator."""

from __future__ import annotations

from typing import Any

import kmock
import pytest
from bookkit import resync
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from opkit import NODES, VD, Cluster, Operator, node, vd

from vllmfit.core.memory import Footprint
from vllmfit.core.placement import Booking, Ledger
from vllmfit.core.spec import api
from vllmfit.operator.booking import draining
from vllmfit.operator.booking.state import Store

PRODUCTS = ("NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-40GB")
GIB = 1 << 30
NAMES = ("n0", "n1", "n2")
KEYS = ("d0", "d1", "d2", "d3")

NODE = st.one_of(st.none(), st.tuples(st.sampled_from(range(len(PRODUCTS))), st.integers(1, 3)))
BOOKING = st.tuples(st.integers(0, 1), st.sampled_from(NAMES), st.integers(0, 3), st.sampled_from([10, 30, 50]))
STATUS = st.one_of(st.none(), st.just("Unschedulable"),  # a replica books each GPU once (the operator writes no other)
                   st.lists(BOOKING, min_size=1, max_size=3, unique_by=lambda b: b[:3]))
CLUSTER = st.tuples(st.tuples(*[NODE] * len(NAMES)), st.tuples(*[STATUS] * len(KEYS)))
DRIFT = st.lists(st.tuples(st.sampled_from(["release", "restore", "node"]), st.sampled_from(KEYS + NAMES),
                           st.lists(BOOKING, max_size=2)), max_size=4)
DRAINS = st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(NAMES), st.integers(0, 3),
                            st.sampled_from([10, 70])), max_size=2)


def node_obj(name: str, spec: tuple[int, int]) -> dict[str, Any]:
    product, count = spec
    return {"metadata": {"name": name, "labels": {"nvidia.com/gpu.product": PRODUCTS[product],
                                                  "nvidia.com/gpu.count": str(count)}}}


def status(entries: Any) -> dict[str, Any]:
    """An admitted status booking `entries` ((replica, node, index, GiB)), as the API keeps it."""
    if entries == "Unschedulable":
        return {"phase": "Unschedulable", "reasons": ["no room"]}
    where: dict[tuple[int, str], list[int]] = {}
    for replica, n, i, _ in entries:
        where.setdefault((replica, n), []).append(i)
    return {"phase": "Admitted",
            "placement": [{"replica": r, "node": n, "gpus": [{"index": i} for i in sorted(set(ix))]}
                          for (r, n), ix in sorted(where.items())],
            "memory": [{"node": n, "index": i, "replica": r, "weightsBytes": gib * GIB, "kvCacheBytes": 0,
                        "activationBytes": 0, "overheadBytes": 0, "totalBytes": gib * GIB}
                       for r, n, i, gib in entries]}


def listing(cluster: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    nodes, statuses = cluster
    objs = []
    for i, (key, st_) in enumerate(zip(KEYS, statuses, strict=True)):
        if st_ is not None:
            objs.append({"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND,
                         "metadata": {"name": key, "namespace": "ns", "uid": f"uid-{key}", "generation": 1,
                                      "creationTimestamp": f"2030-01-01T00:00:{i:02d}Z"},
                         "spec": {"model": "Qwen/Qwen2.5-7B-Instruct"}, "status": status(st_)})
    return [node_obj(n, s) for n, s in zip(NAMES, nodes, strict=True) if s is not None], objs


def order(b: Booking) -> tuple[Any, ...]:
    return b.replica, b.node, b.index, b.footprint.total


def state(led: Ledger, groups: set[Any]) -> tuple[Any, ...]:
    """Everything a decision reads of a ledger, without what only tells its history (versions,
    empty leftovers of removed nodes, which lazy indices were built: `groups`, the group sizes
    to compare, are built in both)."""
    return (dict(led.nodes), {k: sorted(led.bookings_of(k), key=order) for k in led.deployments()},
            {k: v for k, v in led._used.items() if v}, {(s.node, s.index): led.headroom_bytes(s.node, s.index)
                                                       for s in led.slots()},
            {t: list(ix) for t, ix in led._free.items() if list(ix)},
            {g: lst for g in sorted(groups, key=str) if (lst := list(led.group_index(*g)))},
            {n: {i: dict(b) for i, b in book.items() if b} for n, book in led._on_gpu.items()
             if any(book.values())},
            {k: v for k, v in led.census.classes.items() if v},
            {t: {n: c for n, c in per.items() if c} for t, per in led.census.sizes.items() if any(per.values())},
            dict(led.census.refusing), led.beyond_caps(), led.over_budget())


def drains_of(spec: list[tuple[str, str, int, int]]) -> draining.Drains:
    out = draining.Drains()
    for key, n, i, gib in spec:
        d = draining.Drain(f"ns/{key}", 9, f"{n}:{i}", [Booking(f"ns/{key}", 9, n, i, Footprint(gib * GIB, 0, 0, 0, 0, 0))],
                           stopped=True)
        out[d.name] = d
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(CLUSTER, CLUSTER, DRIFT, DRAINS)
@example(((None, None, None), (None, None, None, None)), ((None, None, None), (None, None, None, None)),
         [("restore", "d0", [(0, "n0", 0, 10), (0, "n0", 0, 10)]), ("release", "d0", [])], [])  # phantom bytes
def test_a_resync_leaves_the_ledger_a_fresh_rebuild_gives(before: Any, after: Any, drift: list, drains: list) -> None:
    store = Store()
    store.rebuild(*listing(before))
    store.books.drains = drains_of(drains)
    draining.carry(store.books.ledger, store.books.drains)
    led = store.books.ledger
    for what, name, entries in drift:  # the writer's ledger drifted from the cluster (events missed, bugs)
        if what == "release":
            led.release(f"ns/{name}")
        elif what == "restore":
            led.restore(f"ns/{name}", [Booking(f"ns/{name}", r, n, i, Footprint(g * GIB, 0, 0, 0, 0, 0))
                                       for r, n, i, g in entries])
        elif name in led.nodes:
            led.remove_node(name)
    nodes, deployments = listing(after)
    store.resync(nodes, deployments)

    fresh = Store()  # what the resync did before issue 32: a new ledger from the listing, drains carried
    fresh.rebuild(nodes, deployments)
    draining.carry(fresh.books.ledger, store.books.drains)
    groups = {*store.books.ledger._groups, *fresh.books.ledger._groups}
    assert state(store.books.ledger, groups) == state(fresh.books.ledger, groups)
    assert {k: r.admitted for k, r in store.cache.records.items()} == \
           {k: r.admitted for k, r in fresh.cache.records.items()}


def test_an_idle_resync_changes_nothing_publishes_nothing_and_parses_no_status(monkeypatch: Any) -> None:
    cluster = ((0, 2), (1, 3), None), ([(0, "n0", 0, 30)], [(0, "n1", 1, 10), (1, "n1", 2, 10)], "Unschedulable",
                                       None)
    store = Store()
    store.rebuild(*listing(cluster))
    store.resync(*listing(cluster))  # the first one learns which status books what
    store.cache.pins_all = False  # the children's look after the rebuild (handlers.writes.pinned_anew)
    parsed = []
    validate = api.VLLMDeploymentStatus.model_validate
    monkeypatch.setattr(api.VLLMDeploymentStatus, "model_validate",
                        lambda *a, **k: parsed.append(1) or validate(*a, **k))
    ledger, version = store.books.ledger, store.books.version
    store.resync(*listing(cluster))  # the same listing again (a new copy, as the API gives it)
    store.books.publish()
    assert store.books.ledger is ledger and store.books.version == version
    assert not store.cache.resynced and parsed == []
    assert not store.cache.pins_all  # no record or booking changed: the children need no new look

    changed = (cluster[0], ([(0, "n0", 0, 50)], *cluster[1][1:]))  # d0's status changed behind its back
    store.resync(*listing(changed))
    assert store.cache.resynced.deployments == 1 and store.cache.resynced.nodes == 0
    assert len(parsed) == 2  # the changed status, read into a new record and into its bookings
    assert [b.footprint.total for b in store.books.ledger.bookings_of("ns/d0")] == [50 * GIB]
    assert store.books.ledger is not ledger and ledger.bookings_of("ns/d0")[0].footprint.total == 30 * GIB


pytestmark = pytest.mark.looptime  # the operator's tests below: hang guards in virtual seconds


def silently(km: Any, resource: str, name: str, obj: dict[str, Any] | None, ns: str | None = None) -> None:
    """Change (or with None delete) an object in the emulated API without a watch event: an event
    the operator never got."""
    key = (kmock.resource(resource), ns, name)
    if obj is None:
        del km.objects[key]
    else:
        km.objects[key] = obj


async def test_drift_behind_the_operators_back_is_repaired_by_the_next_resync(
        km: Any, cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=2))
    await cluster.create(node("gpu-b", gpus=1))
    for name in ("a", "b", "c"):
        await cluster.create(vd(name, "Qwen/Qwen2.5-7B-Instruct", maxModelLen=8192))
        await cluster.phase(name, "Admitted")
    store = cluster.store
    await store.writer.flush()
    await resync(store)  # a decision's bookings take the form their status gives them (parts merged)
    await resync(store)
    assert not store.cache.resynced  # a quiet operator: its ledger says what the cluster says

    booked = {k: store.books.ledger.bookings_of(k) for k in store.books.ledger.deployments()}
    gone, kept = sorted(booked)[:2]
    async with store.books.changing():  # the writer's ledger forgot a booking (a bug, a lost step)
        store.books.ledger.release(kept)
    silently(km, VD, gone.split("/")[1], None, "default")  # deleted; the operator never heard of it
    relabelled = dict(cluster.get(NODES, "gpu-b", None))
    relabelled["metadata"] = {**relabelled["metadata"], "labels": {
        **relabelled["metadata"]["labels"], "nvidia.com/gpu.product": "NVIDIA-L40S"}}
    silently(km, NODES, "gpu-b", relabelled)  # its GPU is another product now; no event came

    await resync(store)
    led = store.books.ledger
    assert led.bookings_of(kept) == booked[kept]  # restored from its status
    assert led.bookings_of(gone) == [] and gone not in store.cache.records  # released
    assert led.nodes["gpu-b"].gpus[0].gpu.product == "NVIDIA-L40S"  # the node as its object says
    assert store.cache.resynced.nodes == 1 and store.cache.resynced.deployments == 2


def test_the_resync_takes_at_most_its_share_of_a_core() -> None:
    """The periodic resync lists and compares every object (4.3 s of CPU at 5,000 deployments,
    measured by benchmarks/operator_scale.py): the next one waits --resync-seconds, or 9 times the
    last one's CPU when that is longer (defaults.RESYNC_SHARE, 10 % of a core)."""
    from vllmfit.core import defaults
    from vllmfit.operator.handlers.startup import resync_wait

    assert defaults.RESYNC_SHARE == 0.1
    assert resync_wait(30.0, 0.2) == 30.0  # 500 deployments: the period as set
    assert resync_wait(30.0, 4.3) == pytest.approx(38.7)  # 5,000: 4.3 s in 43 s, a tenth of a core
    assert resync_wait(30.0, 40.0) == pytest.approx(360.0)
    assert resync_wait(5.0, 1.0) == pytest.approx(9.0)
