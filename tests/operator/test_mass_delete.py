"""Deleting many VLLMDeployments at once (issue 32's churn run: 200 deleted together).

Each deletion's `forget` ends with `finish`, whose writes await one after another; meanwhile the
other deletions forget their records. A key `finish` was given (a neighbour whose children it
rewrites) may so be gone by the time its turn comes: it is skipped, not looked up. Before, the
lookup raised KeyError: the delete handler failed, Kopf retried it 60 s later with the finalizer
still set, and 192 of 200 deleted objects were still there when the emulator went quiet.
Then a record being deleted was pulled into every other deletion's writes, which listed the pods
of its drains: a mass delete made a quadratic number of listings (docs/operator.md, "Sixth round").
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from bookkit import two_nodes

from vllmfit.core.memory import Footprint
from vllmfit.operator.booking import draining
from vllmfit.operator.handlers import writes
from vllmfit.operator.handlers.common import Effects


async def test_a_record_forgotten_while_finish_writes_is_skipped(monkeypatch: Any) -> None:
    store = two_nodes()
    keys = sorted(store.cache.records)  # three admitted deployments, each to be written
    first, gone = keys[0], keys[1]
    written: list[tuple[str, str]] = []

    async def step(s: Any, key: str, write: writes.Write, strict: bool) -> bool:
        written.append((key, write.what))
        if key == first:  # while its write awaits, another deletion forgets `gone`
            s.cache.records.pop(gone, None)
        await asyncio.sleep(0)
        return True

    monkeypatch.setattr(writes, "_step", step)
    fx = Effects()
    fx.sync.update(keys)
    await writes._write(store, fx, strict=False)  # raised KeyError before the fix
    assert {k for k, _ in written} == set(keys) - {gone}
    assert [w for k, w in written if k == keys[2]] == ["its status", "its Deployments"]  # booked, then run


async def test_a_forgotten_record_is_skipped_after_a_failed_stop_too(monkeypatch: Any) -> None:
    """The branch that books nothing new after a failed stop looked the record up as well."""
    store = two_nodes()
    keys = sorted(store.cache.records)
    store.cache.records[keys[0]].admitted = False  # stopping: its write fails
    written: list[str] = []

    async def step(s: Any, key: str, write: writes.Write, strict: bool) -> bool:
        written.append(key)
        s.cache.records.pop(keys[1], None)  # forgotten meanwhile
        await asyncio.sleep(0)
        return False

    monkeypatch.setattr(writes, "_step", step)
    fx = Effects()
    fx.sync.update(keys)
    await writes._write(store, fx, strict=False)
    assert written == [keys[0]]  # the failed stop; nothing else written, nothing looked up that is gone
    assert store.cache.records[keys[2]].synced is None  # left to the resync


def test_a_record_being_deleted_is_not_pulled_into_other_writes() -> None:
    """writes.pinned_anew (the records whose children another step rewrites) leaves out a record
    whose deletion is under way (`going`): its own `forget` deletes its children. Before, a mass
    delete pulled every record still being deleted into every other deletion's writes, and each
    of those then listed the pods of all their drains: 35 pod and 35 ReplicaSet listings per
    deletion at 100 deleted together."""
    store = two_nodes()
    keys = sorted(store.cache.records)
    store.cache.records[keys[0]].going = True
    store.cache.pins_all = True  # every record looked at
    assert writes.pinned_anew(store) == keys[1:]
    store.cache.pins_dirty.update(b.node for b in store.books.ledger.bookings_of(keys[0]))
    assert keys[0] not in writes.pinned_anew(store)


async def test_a_deletion_lists_only_its_own_children(monkeypatch: Any) -> None:
    """`forget` sweeps one deployment's Deployments and pods: it asks the API for those of that
    deployment (its label), not for every one of vllmfit's in the namespace, which made each
    deletion's listing grow with the namespace (2,000 deleted at once: 246 s)."""
    from vllmfit.operator.handlers import sweep as sweeping
    from vllmfit.operator.rendering import builders

    store = two_nodes()
    store.api = object()  # never called: the listings are answered below
    asked: list[str] = []

    async def listed(call: Any, namespace: str, label_selector: str) -> dict[str, Any]:
        asked.append(label_selector)
        return {"items": []}

    monkeypatch.setattr(sweeping, "as_json", listed)
    await sweeping.sweep(store, "ns", only="a")
    assert asked == [builders.selector("a")] * 2  # its Deployments, then its pods


def test_the_records_beside_a_drain_are_looked_at_when_it_changes_not_while_it_lasts() -> None:
    """writes.pinned_anew looks at the records on a node whose drains began, grew or ended since
    the last look. Before, it looked at the records beside every drain on every call for as long
    as the drain lasted: in a mass delete (hundreds of drains for seconds), each of the thousand
    steps compared the children of most records (48,159 children_state calls, a third of the
    operator's time, deleting 500 together on 100 nodes)."""
    store = two_nodes()
    on_a = sorted(k for k in store.cache.records if any(b.node == "gpu-a" for b in store.books.ledger.bookings_of(k)))
    assert on_a and writes.pinned_anew(store)  # after the rebuild: every record
    assert writes.pinned_anew(store) == []
    held = [b for b in store.books.ledger.bookings_of(on_a[0]) if b.node == "gpu-a"]
    d = draining.Drain("default/gone", 0, "gpu-a:0", [dataclasses.replace(b, footprint=Footprint(1 << 30, 0, 0, 0, 0, 0))
                                                      for b in held], stopped=True)
    store.books.drains[d.name] = d  # a drain began on gpu-a
    assert writes.pinned_anew(store) == on_a
    assert writes.pinned_anew(store) == []  # it lasts: nothing to look at again (before: on_a every time)
    store.books.drains[d.name] = dataclasses.replace(d, bookings=held)  # the same placement stopped again, larger
    assert writes.pinned_anew(store) == on_a
    assert writes.pinned_anew(store) == []
    del store.books.drains[d.name]  # its pods are gone
    assert writes.pinned_anew(store) == on_a
    assert writes.pinned_anew(store) == []


async def test_a_step_leaves_a_record_being_deleted_to_its_own_deletion(monkeypatch: Any) -> None:
    """Whatever put a record being deleted (`going`) into a step's writes (a node event's
    decide.update_node, a rebooked reservation, pinned_anew), `finish` leaves it out: its own
    deletion (`forget`) stops its children and ends its drains. Before, the step wrote its
    children and status again and listed the pods of its drains, as in the quadratic mass delete."""
    store = two_nodes()
    keys = sorted(store.cache.records)
    going = keys[0]
    store.cache.records[going].going = True
    held = store.books.ledger.bookings_of(going)
    d = draining.Drain(going, 0, f"{held[0].node}:{held[0].index}", list(held), stopped=True)
    store.books.drains[d.name] = d
    written: list[str] = []
    listed: list[set[str] | None] = []

    async def step(s: Any, key: str, write: writes.Write, strict: bool) -> bool:
        written.append(key)
        return True

    async def ended(s: Any, which: set[str] | None = None) -> None:
        listed.append(which)

    monkeypatch.setattr(writes, "_step", step)
    monkeypatch.setattr(writes, "ended_drains", ended)
    fx = Effects()
    fx.sync.update(keys)
    await writes.finish(store, fx, strict=False, hold=False)
    assert going not in written and set(written) == set(keys[1:])
    assert listed == []  # before: its drain's pods listed by this step
