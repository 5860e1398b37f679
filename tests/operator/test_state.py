"""The Store without an API server: model resolution, rebuild from listed objects, and the
decision logic of the handlers called directly on a ledger."""

from __future__ import annotations

import asyncio
import copy
import threading
from typing import Any

import pytest
from bookkit import GIB, H100, QWEN7, admitted_status, body, node, obj

from vllmfit.core import defaults, placement
from vllmfit.core.observe import inventory
from vllmfit.core.spec import api
from vllmfit.operator.booking import report
from vllmfit.operator.booking.record import pruned, record_from_object
from vllmfit.operator.booking.state import Store
from vllmfit.operator.handlers import common, decide, nodes
from vllmfit.sources import catalog
from vllmfit.sources.resolve import ModelResolutionError


async def test_request_for_catalog_inline_and_unknown_models() -> None:
    store = Store()
    req = await store.request_for(obj())
    assert req.model == catalog.model(QWEN7) and req.key == "ns/x"
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
              "hidden_size": 256, "num_attention_heads": 4, "vocab_size": 1000, "max_position_embeddings": 512}
    inline = await store.request_for(obj(model="acme/tiny", modelConfig=config, modelParams=12345))
    assert (inline.model.name, inline.model.params, inline.model.num_layers) == ("acme/tiny", 12345, 2)
    with pytest.raises(ModelResolutionError) as e:
        await store.request_for(obj(model="llama-9000"))
    assert not e.value.transient and "llama-9000" in str(e.value)
    with pytest.raises(ModelResolutionError, match="spec.modelConfig"):
        await store.request_for(obj(model="acme/bad", modelConfig={"model_type": "llama"}))


async def test_default_image_applies_only_when_the_spec_names_none() -> None:
    store = Store()
    store.options.default_image = "registry.local/vllm:v0.21.0"
    assert (await store.request_for(obj())).spec.image == "registry.local/vllm:v0.21.0"
    assert (await store.request_for(obj(image="vllm/vllm-openai:v0.19.0"))).spec.image == "vllm/vllm-openai:v0.19.0"


def test_rebuild_restores_the_same_ledger_from_statuses_and_nodes() -> None:
    live = Store()
    live.rebuild([node("gpu-a", 2), node("cpu-only") | {"metadata": {"name": "cpu-only"}}], [])
    statuses = {n: admitted_status(live, n, **s) for n, s in [("a", {}), ("bb", {"tensorParallelSize": 2}),
                                                                ("ccc", {"maxModelLen": 4096})]}
    rejected = body("dddd", {"phase": "Rejected", "reasons": ["bad"]})
    restarted = Store()
    restarted.rebuild([node("gpu-a", 2)], [body(n, st) for n, st in statuses.items()] + [rejected])
    assert restarted.books.ready.is_set()
    for key in live.books.ledger.deployments():
        assert [(b.replica, b.node, b.index, b.footprint.total) for b in restarted.books.ledger.bookings_of(key)] == \
               [(b.replica, b.node, b.index, b.footprint.total) for b in live.books.ledger.bookings_of(key)]
    for i in (0, 1):
        assert restarted.books.ledger.used_bytes("gpu-a", i) == live.books.ledger.used_bytes("gpu-a", i)
    rec = restarted.cache.records["ns/bb"]
    assert rec.admitted and rec.children == {0} and rec.flags == api.Flags.model_validate(statuses["bb"]["flags"])
    assert restarted.cache.records["ns/dddd"].outcome == "Rejected" and not restarted.books.ledger.bookings_of("ns/dddd")


def test_record_from_a_status_with_a_pending_update_waits_for_room() -> None:
    st = {"phase": "Admitted", "observedGeneration": 2, "conditions": [
        {"type": "Admitted", "status": "False", "reason": "UpdateUnschedulable", "message": "no room"}]}
    rec = record_from_object(body("x", st))
    assert rec.admitted and rec.waiting and rec.observed_generation == 2
    assert not record_from_object(body("y", {"phase": "Rejected"})).waiting
    assert record_from_object(body("z", {"phase": "Unschedulable"})).waiting
    assert record_from_object(body("w", {"phase": "Bogus"})).outcome == "Pending"  # unreadable status


def test_an_update_that_does_not_fit_keeps_the_admitted_spec() -> None:
    store = Store()
    store.rebuild([node("gpu-a", 1)], [])
    admitted_status(store, "x", kvCache={"concurrency": 8})
    admitted_status(store, "yy", kvCache={"concurrency": 8})  # a neighbour: together they leave less than x's update needs
    rec = store.cache.records["ns/x"]
    before = store.books.ledger.bookings_of("ns/x")
    flags = rec.flags
    rec.generation = 2
    big = obj("x", maxModelLen=32768, kvCache={"concurrency": 16})
    req = placement.request_from_object(big, catalog.model(QWEN7))
    fx = common.Effects()
    with store.books.step():
        decide.apply_decision(store, rec, req, placement.decide(store.books.ledger, req), fx)
    st = report.status(rec, store.books.ledger)
    assert st["phase"] == "Admitted" and st["flags"] == flags.model_dump(by_alias=True, mode="json")
    assert store.books.ledger.bookings_of("ns/x") == before
    admitted = next(c for c in st["conditions"] if c["type"] == "Admitted")
    assert (admitted["status"], admitted["reason"]) == ("False", "UpdateUnschedulable")
    assert "still serving the admitted spec" in admitted["message"]
    assert rec.waiting and rec.admitted_request is not req and fx.sync == set()
    assert [e[2] for e in fx.events] == ["UpdateUnschedulable"]


def overfull_gpu_a() -> tuple[Store, list[placement.Booking]]:
    """Two fixed-size deployments on gpu-a, then foreign use grows there by 10 GiB more than is
    free; gpu-b is empty. Returns the store and the oldest one's bookings."""
    store = Store()
    store.rebuild([node("gpu-a", 1), node("gpu-b", 1)], [])
    for name in ("a", "bb"):  # fixed sizes: neither can shrink its context to stay
        admitted_status(store, name, placement={"nodeName": "gpu-a"}, maxModelLen=32768, kvCache={"concurrency": 8})
    old_a = store.books.ledger.bookings_of("ns/a")
    nodes = {n.name: n for n in store.books.ledger.nodes.values()}
    grown = placement.NodeInfo("gpu-a", {}, tuple(placement.GpuSlot(s.node, s.index, s.gpu, s.uuid,
                                                                    foreign_bytes=store.books.ledger.headroom_bytes(
                                                                        "gpu-a", 0) + 10 * GIB)
                                                  for s in nodes["gpu-a"].gpus))
    store.books.ledger.set_node(grown)
    assert store.books.ledger.headroom_bytes("gpu-a", 0) < 0
    return store, old_a


async def test_replan_moves_the_newest_off_an_overfull_gpu_and_keeps_the_oldest() -> None:
    store, old_a = overfull_gpu_a()
    used = store.books.ledger.used_bytes("gpu-a", 0)
    fx = common.Effects()
    async with store.books.transaction():
        await decide.replan(store, "gpu-a", fx, "node gpu-a changed")
    assert store.books.ledger.bookings_of("ns/a") == old_a  # the oldest stays
    moved = store.books.ledger.bookings_of("ns/bb")
    assert {b.node for b in moved} == {"gpu-b"}
    assert store.books.ledger.headroom_bytes("gpu-a", 0) >= 0 and store.books.ledger.used_bytes("gpu-a", 0) < used + 10 * GIB
    assert [(e[1], e[2]) for e in fx.events] == [("Warning", "Moved")]
    assert "node gpu-a changed" in fx.events[0][3] and fx.sync == {"ns/bb"}


async def test_a_replan_past_its_time_limit_evicts_without_moving_and_never_blocks_the_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Re-placing runs in a worker with DECIDE_TIMEOUT_S; past it the evictions happen anyway
    (the GPU is back under budget at once) and the evicted deployment waits for room."""
    store, old_a = overfull_gpu_a()
    release = threading.Event()
    real = placement.replan

    def slow(ledger: placement.Ledger, requests: Any, **kw: Any) -> placement.Replan:
        if kw.get("place", True):
            release.wait(30)  # a search that takes too long
        return real(ledger, requests, **kw)

    monkeypatch.setattr(placement, "replan", slow)
    monkeypatch.setattr(defaults, "DECIDE_TIMEOUT_S", 0.2)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    fx = common.Effects()
    try:
        async with store.books.transaction():
            await decide.replan(store, "gpu-a", fx, "node gpu-a changed")
    finally:
        release.set()
        ticker.cancel()
    assert ticks >= 5  # the loop kept serving while the worker searched
    assert store.books.ledger.bookings_of("ns/a") == old_a and store.books.ledger.bookings_of("ns/bb") == []
    assert store.books.ledger.over_budget() == []
    rec = store.cache.records["ns/bb"]
    assert not rec.admitted and rec.outcome == "Unschedulable" and rec.waiting
    message = next(c.message for c in rec.conditions if c.type == "Admitted")
    assert message.startswith("node gpu-a changed: re-placing it took more than 0.2 s"), message
    assert "ns/bb" in fx.sync  # its Deployment is deleted


async def test_removing_a_node_makes_what_fits_nowhere_unschedulable() -> None:
    store = Store()
    store.rebuild([node("gpu-a", 1)], [])
    admitted_status(store, "a")
    store.cache.records["ns/a"].children = {0}
    store.books.ledger.remove_node("gpu-a")
    fx = common.Effects()
    async with store.books.transaction():
        await decide.replan(store, "gpu-a", fx, "node gpu-a was removed")
    rec = store.cache.records["ns/a"]
    assert not rec.admitted and rec.outcome == "Unschedulable" and rec.waiting
    assert store.books.ledger.bookings_of("ns/a") == []
    assert fx.sync == {"ns/a"}  # its Deployment is deleted
    assert "node gpu-a was removed" in fx.events[-1][3]


def test_parse_turns_bad_objects_into_one_line_messages() -> None:
    with pytest.raises(common.Invalid, match="^spec.replicas: "):
        common.parse(body("x", replicas=-1))
    with pytest.raises(common.Invalid, match="^spec.model: Field required$"):
        common.parse({"metadata": {"name": "x"}, "spec": {}})
    with pytest.raises(common.Invalid, match="--gpu-memory-utilization is set by vllmfit"):
        common.parse(body("x", extraArgs=["--gpu-memory-utilization", "0.9"]))
    assert common.parse(copy.deepcopy(body("x"))).spec.model == QWEN7


def test_resync_catches_a_standby_up_and_changes_nothing_on_the_active_replica() -> None:
    active = Store()
    active.rebuild([node("gpu-a", 2)], [])
    listing = []
    for name in ("a", "bb"):
        st = admitted_status(active, name)
        active.cache.records[f"ns/{name}"].written = st
        listing.append(body(name, pruned(st)))  # what the API server keeps after the merge patches
    standby = Store()
    standby.rebuild([node("gpu-a", 2)], listing[:1])  # started before "bb" was admitted
    assert standby.books.ledger.bookings_of("ns/bb") == []

    standby.resync([node("gpu-a", 2)], listing)
    for key in ("ns/a", "ns/bb"):
        assert [(b.node, b.index, b.footprint.total) for b in standby.books.ledger.bookings_of(key)] == \
               [(b.node, b.index, b.footprint.total) for b in active.books.ledger.bookings_of(key)]
    assert standby.cache.records["ns/bb"].admitted

    kept = dict(active.cache.records)
    used = {i: active.books.ledger.used_bytes("gpu-a", i) for i in (0, 1)}
    active.resync([node("gpu-a", 2)], listing)
    assert all(active.cache.records[k] is kept[k] for k in kept)  # its own records (pods, conditions) stay
    assert {i: active.books.ledger.used_bytes("gpu-a", i) for i in (0, 1)} == used

    active.resync([node("gpu-a", 2)], listing[1:])  # "a" was deleted meanwhile
    assert "ns/a" not in active.cache.records and active.books.ledger.bookings_of("ns/a") == []


def test_statuses_written_by_the_previous_active_replica_are_adopted_once() -> None:
    active = Store()
    active.rebuild([node("gpu-a", 2)], [])
    st = admitted_status(active, "a")
    taker = Store()  # the standby that takes over: it started before "a" was admitted
    taker.rebuild([node("gpu-a", 2)], [])
    assert taker.adopt(body("a", pruned(st)))
    assert taker.cache.records["ns/a"].admitted and not taker.cache.records["ns/a"].mine
    assert [b.footprint.total for b in taker.books.ledger.bookings_of("ns/a")] == \
           [b.footprint.total for b in active.books.ledger.bookings_of("ns/a")]
    assert not taker.adopt(body("a", pruned(st)))  # the same status again: nothing new
    taker.cache.records["ns/a"].mine = True
    assert not taker.adopt(body("a", {"phase": "Unschedulable"}))  # echoes of its own writes are ignored
    assert not taker.adopt(body("new", {}))  # a new object is for the create handler


def test_own_pods_memory_in_the_agent_inventory_is_not_counted_twice() -> None:
    """The agent reports every process on a GPU; the memory of vllmfit's own pods is already
    booked, so only the rest is foreign (before the fix it was booked AND foreign)."""
    live = Store()
    live.rebuild([node("gpu-a", 1)], [])
    st = admitted_status(live, "a", maxModelLen=4096)
    st["podUids"] = ["pod-of-a"]
    booked = live.books.ledger.used_bytes("gpu-a", 0)
    own, other = 20 * GIB, 3 * GIB  # the vLLM process of ns/a, and somebody else's process
    inv = inventory.GpuInventory(sampled_at="2030-01-01T00:00:00Z", gpus=[inventory.InventoryGpu(
        index=0, uuid="GPU-0", product=H100, total_bytes=81559 << 20, used_bytes=own + other + GIB,
        processes=[inventory.InventoryProcess(pid=10, used_bytes=own, pod_uid="pod-of-a"),
                   inventory.InventoryProcess(pid=11, used_bytes=other, pod_uid="someone-else")])])
    with_agent = node("gpu-a", 1)
    with_agent["metadata"]["annotations"] = {
        "vllmfit.dev/gpu-inventory": inv.model_dump_json(by_alias=True, exclude_none=True)}
    restarted = Store()
    restarted.rebuild([with_agent], [body("a", st, maxModelLen=4096)])
    # foreign = the other pod's 3 GiB + 1 GiB no process explains; ns/a's 20 GiB is its booking
    assert restarted.books.ledger.slot("gpu-a", 0).foreign_bytes == other + GIB
    assert restarted.books.ledger.used_bytes("gpu-a", 0) == booked + other + GIB


def test_a_node_whose_labels_turn_bad_keeps_its_gpus_on_resync() -> None:
    # issue 14: a non-numeric nvidia.com/gpu.count made the node count as having no GPUs (and every
    # deployment on it was deleted). Now the node keeps its last good state until it is fixed.
    store = Store()
    good = node("gpu-a", 2)
    store.rebuild([good], [])
    bad = copy.deepcopy(good)
    bad["metadata"]["labels"]["nvidia.com/gpu.count"] = "two"
    store.resync([bad], [])
    assert [s.index for s in store.books.ledger.nodes["gpu-a"].gpus] == [0, 1]
    fixed = copy.deepcopy(good)
    fixed["metadata"]["labels"]["nvidia.com/gpu.count"] = "1"
    store.resync([fixed], [])
    assert [s.index for s in store.books.ledger.nodes["gpu-a"].gpus] == [0]


def test_refused_node_data_on_rebuild_is_reported() -> None:
    bad = node("gpu-a", 2)
    bad["metadata"]["labels"]["nvidia.com/gpu.count"] = "-3"
    problems = Store().rebuild([bad], [])
    assert any("nvidia.com/gpu.count" in p for p in problems)


def test_the_node_handler_keeps_the_last_good_state() -> None:
    good = nodes.node_info(node("gpu-a", 2))
    assert good is not None
    bad = node("gpu-a", 2)
    bad["metadata"]["annotations"] = {"vllmfit.dev/gpu-inventory": "{not json"}
    with pytest.raises(placement.NodeDataError, match="is not a GPU inventory"):
        nodes.node_info(bad, previous=good)  # on_node catches it and keeps `good`


def test_resync_ignores_a_stale_inventory_and_uses_the_gfd_labels() -> None:
    import json
    from datetime import UTC, datetime, timedelta

    from vllmfit.core import defaults

    def with_inventory(sampled: datetime, used: int) -> dict[str, Any]:
        n = node("gpu-a", 1)
        inv = {"sampledAt": sampled.strftime("%Y-%m-%dT%H:%M:%SZ"), "gpus": [
            {"index": 0, "uuid": "GPU-0", "product": H100, "totalBytes": 81559 * defaults.MIB, "usedBytes": used}]}
        n["metadata"]["annotations"] = {defaults.INVENTORY_ANNOTATION: json.dumps(inv)}
        return n

    store = Store()
    fresh = datetime.now(UTC)
    store.rebuild([with_inventory(fresh, 30 << 30)], [])
    assert store.books.ledger.nodes["gpu-a"].gpus[0].foreign_bytes == 30 << 30
    old = fresh - timedelta(seconds=defaults.INVENTORY_STALE_SECONDS + 60)  # the agent stopped publishing
    store.resync([with_inventory(old, 30 << 30)], [])
    slot = store.books.ledger.nodes["gpu-a"].gpus[0]
    assert slot.foreign_bytes == 0 and slot.uuid is None  # the GFD labels' GPU, not the stale inventory
