"""The drain of a resize in place (issue 22, item 1): a replica that keeps its GPU but gets a
smaller footprint keeps the difference booked, held only by its pods written for the old booking
(`vllmfit.dev/booked`), until they are gone. Pure functions of operator/booking/draining.py, on a ledger
with one H100 and hand-made bookings (GiB numbers chosen to be read at a glance)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from vllmfit.core.memory import Footprint
from vllmfit.core.placement import Booking, GpuSlot, Ledger, NodeInfo
from vllmfit.operator.booking import draining
from vllmfit.operator.rendering import builders
from vllmfit.sources import catalog

GiB = 1 << 30
KEY = "default/a"


def ledger() -> Ledger:
    gpu = catalog.gpu("NVIDIA-H100-80GB-HBM3")
    return Ledger([NodeInfo("n", {}, (GpuSlot("n", 0, gpu), GpuSlot("n", 1, gpu)))])


def booking(gib: int, index: int = 0, replica: int = 0, key: str = KEY) -> Booking:
    return Booking(key, replica, "n", index, Footprint(gib * GiB, 0, 0, 0, 0, 0))


def pod(booked: str | None, where: str = "n:0", phase: str = "Running") -> dict[str, Any]:
    annotations = {builders.ANNOTATION_PLACEMENT: where}
    if booked is not None:
        annotations[builders.ANNOTATION_BOOKED] = booked
    return {"metadata": {"namespace": "default", "annotations": annotations,
                         "labels": {builders.LABEL_DEPLOYMENT: "a", builders.LABEL_REPLICA: "0"}},
            "status": {"phase": phase}}


def resize(ledger: Ledger, drains: draining.Drains, old: list[Booking], new: list[Booking]) -> list[draining.Drain]:
    ledger.restore(KEY, new)
    draining.revive(ledger, drains, KEY)
    return draining.hold(ledger, drains, KEY, old)


def test_a_smaller_footprint_in_place_drains_the_difference_for_the_old_pods() -> None:
    lg, drains = ledger(), draining.Drains()
    lg.restore(KEY, [booking(40)])
    (d,) = resize(lg, drains, [booking(40)], [booking(25)])
    assert d.booked == f"0={40 * GiB}" and d.where == "n:0"
    assert [b.footprint.total for b in d.bookings] == [15 * GiB]  # 40 - 25
    assert lg.used_bytes("n", 0) == 40 * GiB  # the new booking and the drain: the old pod's footprint
    d.stopped = True
    assert draining.pod_holds(pod(f"0={40 * GiB}"), d)  # the old pod
    assert not draining.pod_holds(pod(f"0={25 * GiB}"), d)  # the new one
    assert draining.pod_holds(pod(None), d)  # written before vllmfit wrote the annotation: may be the old one
    assert not draining.pod_holds(pod(f"0={40 * GiB}", phase="Succeeded"), d)
    assert draining.ended(drains, "default", "a", [pod(f"0={25 * GiB}")]) == [d.name]
    assert draining.ended(drains, "default", "a", [pod(f"0={40 * GiB}"), pod(f"0={25 * GiB}")]) == []


def test_a_larger_or_equal_footprint_in_place_drains_nothing() -> None:
    for new in (40, 55):
        lg, drains = ledger(), draining.Drains()
        lg.restore(KEY, [booking(40)])
        assert resize(lg, drains, [booking(40)], [booking(new)]) == [] and drains == {}
        assert lg.used_bytes("n", 0) == new * GiB


def test_only_the_gpus_that_shrank_drain() -> None:
    lg, drains = ledger(), draining.Drains()
    old = [booking(40, 0), booking(30, 1)]
    lg.restore(KEY, old)
    (d,) = resize(lg, drains, old, [booking(25, 0), booking(35, 1)])
    assert [(b.index, b.footprint.total) for b in d.bookings] == [(0, 15 * GiB)]
    assert d.booked == f"0={40 * GiB},1={30 * GiB}" and d.where == "n:0,1"


def test_a_resize_back_revives_the_old_booking() -> None:
    lg, drains = ledger(), draining.Drains()
    lg.restore(KEY, [booking(40)])
    resize(lg, drains, [booking(40)], [booking(25)])
    assert resize(lg, drains, [booking(25)], [booking(40)]) == [] and drains == {}
    assert lg.used_bytes("n", 0) == 40 * GiB


def test_two_resizes_down_keep_what_each_old_pod_may_hold() -> None:
    lg, drains = ledger(), draining.Drains()
    lg.restore(KEY, [booking(40)])
    resize(lg, drains, [booking(40)], [booking(30)])
    resize(lg, drains, [booking(30)], [booking(20)])
    assert sorted(sum(b.footprint.total for b in d.bookings) for d in drains.values()) == [10 * GiB, 10 * GiB]
    assert lg.used_bytes("n", 0) == 40 * GiB  # the oldest pod may still hold 40


def test_a_replica_set_scaled_to_zero_creates_no_pod() -> None:
    d = draining.Drain(KEY, 0, "n:0", [booking(15)], stopped=True, booked=f"0={40 * GiB}")
    old_rs = {"spec": {"replicas": 1, "template": {"metadata": pod(f"0={40 * GiB}")["metadata"]}}}
    assert draining.set_holds(old_rs, d)
    assert not draining.set_holds({"spec": {**old_rs["spec"], "replicas": 0}}, d)  # kept for the revision history
    new_rs = {"spec": {"replicas": 1, "template": {"metadata": pod(f"0={25 * GiB}")["metadata"]}}}
    assert not draining.set_holds(new_rs, d)


def test_at_start_up_an_old_pod_at_a_booked_place_is_a_drain_of_its_booking() -> None:
    lg = ledger()
    lg.restore(KEY, [booking(25)])
    covered = {(KEY, 0): ("n:0", f"0={25 * GiB}")}
    assert draining.from_pods(lg, [pod(f"0={25 * GiB}"), pod(None)], covered) == {}
    drains = draining.from_pods(lg, [pod(f"0={40 * GiB}")], covered)
    (d,) = drains.values()
    assert d.booked == f"0={40 * GiB}" and d.stopped
    # charged with what the GPU has room for (the pod says where it runs, not how much it uses)
    assert lg.used_bytes("n", 0) == lg.slot("n", 0).budget_bytes


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["set", "del", "pop", "clear"]), st.sampled_from(["default/a", "default/b"]),
                          st.integers(0, 2), st.sets(st.sampled_from([("n", 0), ("n", 1), ("m", 0)]), min_size=1)),
                max_size=30))
def test_the_drains_indexes_answer_as_a_scan_would(ops: list[tuple[str, str, int, set[tuple[str, int]]]]) -> None:
    """draining.Drains keeps its drains by deployment (`of`) and by GPU (`on`), and the nodes whose
    drains changed since the last look (`take_changed`), through any sequence of writes: the same
    answers as a scan of every drain (what each step did before, issue 32)."""
    drains, before = draining.Drains(), {}
    for op, key, replica, gpus in ops:
        d = draining.Drain(key, replica, f"r{replica}", [Booking(key, replica, n, i, Footprint(GiB, 0, 0, 0, 0, 0))
                                                         for n, i in sorted(gpus)])
        if op == "set":
            drains[d.name] = d
        elif op == "del" and d.name in drains:
            del drains[d.name]
        elif op == "pop":
            drains.pop(d.name, None)
        elif op == "clear":
            drains.clear()
        now = {name: {(b.node, b.index) for b in x.bookings} for name, x in drains.items()}
        assert drains.take_changed() == {n for name in now.keys() | before.keys()
                                         if now.get(name) != before.get(name) or op == "set" and name == d.name
                                         for n, _ in now.get(name, set()) | before.get(name, set())}
        before = now
        for k in ("default/a", "default/b"):
            assert {x.name for x in drains.of(k)} == {x.name for x in drains.values() if x.key == k}
        for gpu in (("n", 0), ("n", 1), ("m", 0)):
            assert {x.name for x in drains.on(*gpu)} == {x.name for x in drains.values()
                                                         if any((b.node, b.index) == gpu for b in x.bookings)}
