"""Kill the operator at every write it makes in a small scenario, restart it, and check that
nothing vllmfit runs is unbooked and no GPU is over its budget (issue 14, item 2).

The emulator freezes at the k-th write the operator sends (that write and every later one never
reach the store: the process died just before it), the operator task is cancelled, a new one
starts on what the API holds, and the scenario goes on. Invariants:
- at the crash instant and after the restart: every Deployment vllmfit owns matches the stored,
  admitted placement of a VLLMDeployment, and the bookings of what runs fit every GPU's budget;
- once settled: the stored bookings of the live objects fit every budget too.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any

import kmock
import pytest
from crashing import Crashing
from opkit import (
    DEPLOYMENTS,
    VD,
    Cluster,
    Operator,
    budget,
    node,
    used_from_statuses,
    vd,
)

from vllmfit.core.spec import api
from vllmfit.operator.rendering import builders

pytestmark = pytest.mark.looptime  # hang guards and waits in virtual seconds (issue 29): no wall time

QWEN7 = "Qwen/Qwen2.5-7B-Instruct"
@pytest.fixture
async def crashing() -> Any:
    async with Crashing() as km, kmock.Server(km):
        km.resources.load_bundled()
        km.resources[VD] = kmock.ResourceInfo(
            kind=api.KIND, namespaced=True, singular=api.SINGULAR, shortnames=set(api.SHORT_NAMES),
            subresources={"status"}, verbs={"get", "list", "watch", "create", "patch", "update", "delete"})
        yield km


def running_is_booked(cluster: Cluster, where: str) -> None:
    """Every Deployment vllmfit owns is covered by a stored admitted booking; what runs fits."""
    statuses = {o["metadata"]["name"]: o.get("status") or {} for o in cluster.objects(VD)}
    used: dict[tuple[str, int], int] = {}
    for d in cluster.objects(DEPLOYMENTS):
        meta = d["metadata"]
        if (meta.get("labels") or {}).get(builders.MANAGED_BY) != "vllmfit":
            continue
        owner = meta["labels"][builders.LABEL_DEPLOYMENT]
        st = statuses.get(owner) or {}
        assert st.get("phase") in ("Admitted", "Running", "Failed"), \
            f"{where}: Deployment {meta['name']} runs, but {owner} has no admitted booking ({st.get('phase')})"
        here = meta["annotations"][builders.ANNOTATION_PLACEMENT]
        booked = [p for p in st["placement"] if builders.deployment_name(owner, p["replica"]) == meta["name"]
                  and builders.placement_text(api.ReplicaPlacement.model_validate(p)) == here]
        assert booked, f"{where}: Deployment {meta['name']} runs on {here}, booked: {st['placement']}"
        for m in st["memory"]:
            if m["replica"] == booked[0]["replica"]:
                used[(m["node"], m["index"])] = used.get((m["node"], m["index"]), 0) + m["totalBytes"]
    assert all(v <= budget() for v in used.values()), f"{where}: over budget: {used}"


def stored_fits(cluster: Cluster, where: str) -> None:
    live = [o.get("status") or {} for o in cluster.objects(VD) if not o["metadata"].get("deletionTimestamp")]
    used = used_from_statuses(live)
    assert all(v <= budget() for v in used.values()), f"{where}: stored bookings over budget: {used}"


def scenario(cluster: Cluster) -> list[tuple[str, Callable[[], Awaitable[Any]], Callable[[], bool]]]:
    """(what, action, done): one GPU; a fills it, b waits, a goes, b gets the GPU."""
    def phase(name: str) -> str | None:
        return cluster.status(name).get("phase")

    return [
        ("node", lambda: cluster.create(node("gpu-a", gpus=1)), lambda: True),
        ("create a", lambda: cluster.create(vd("a", QWEN7, maxModelLen=32768, kvCache={"concurrency": 8})),
         lambda: phase("a") == "Admitted" and cluster.get(DEPLOYMENTS, "a-0") is not None),
        ("create b", lambda: cluster.create(vd("b", QWEN7, maxModelLen=32768, kvCache={"concurrency": 16})),
         lambda: phase("b") == "Unschedulable"),
        ("delete a", lambda: cluster.delete("a"),
         lambda: cluster.get(VD, "a") is None and cluster.get(DEPLOYMENTS, "a-0") is None
         and phase("b") == "Admitted" and cluster.get(DEPLOYMENTS, "b-0") is not None),
    ]


async def run(km: Crashing, kill_at: int | None) -> int:
    """The scenario with a crash at the operator's `kill_at`-th write; returns the writes seen."""
    km.kill_at, km.writes = kill_at, 0
    km.killed, km.thaw = asyncio.Event(), asyncio.Event()
    cluster = Cluster(km)
    op = Operator(km)
    await op.start()
    crashed = False
    try:
        for what, action, done in scenario(cluster):
            await action()
            deadline = asyncio.get_running_loop().time() + 15
            while not done():
                if asyncio.get_running_loop().time() > deadline:
                    pytest.fail(f"crash at write {kill_at}: {what} never done; phases {cluster.phases()}, "
                                f"Deployments {[d['metadata']['name'] for d in cluster.objects(DEPLOYMENTS)]}")
                if km.killed.is_set() and not crashed:
                    crashed = True
                    await asyncio.sleep(0.05)  # let in-flight requests reach the frozen emulator
                    await km.kill(op)
                    running_is_booked(cluster, f"crash at write {kill_at} ({what})")
                    await km.restart(op, cluster)
                    continue
                await asyncio.sleep(0.01)
            running_is_booked(cluster, f"after {what}, crash at write {kill_at}")
        await cluster.store.writer.flush()
        running_is_booked(cluster, f"settled, crash at write {kill_at}")
        stored_fits(cluster, f"settled, crash at write {kill_at}")
        return km.writes
    finally:
        km.thaw.set()
        await op.stop()
        await cluster.api.close()


async def test_a_crash_at_any_write_leaves_the_booking_or_nothing_running(crashing: Crashing) -> None:
    n = await run(crashing, None)
    assert n > 5
    step = max(1, int(os.environ.get("VLLMFIT_CRASH_STEP", "1")))
    for k in range(0, n, step):
        # a fresh emulator each time: the same scenario from an empty cluster
        async with Crashing() as km, kmock.Server(km):
            km.resources.load_bundled()
            km.resources[VD] = crashing.resources[VD]
            await asyncio.wait_for(run(km, k), 60)
