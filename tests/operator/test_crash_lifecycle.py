"""Kill the operator at every write it makes while replicas stop and start (issue 22, item 5):
scale-down, delete, move, node loss and re-creation, create + delete, with pods that take
`GRACE` seconds to terminate (tests/operator/kubelet.py plays the ReplicaSet controller and
the kubelet). Invariants, at every instant of every run, crash and restart included:
- for every GPU, the sum over every pod that may be running on it (terminating ones too) is
  within its budget, each pod holding what the stored status booked for it when it started;
- no pod starts where no stored status books its replica;
- at the crash instant, every Deployment vllmfit owns is covered by a stored admitted booking.
And each scenario ends where it should (nothing stuck Admitted on a lost node).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any

import kmock
import pytest
from kubelet import Kubelet, exists, phase, placed
from opkit import DEPLOYMENTS, VD, Cluster, Operator, node, vd
from test_crash import Crashing

from vllmfit.core.spec import api
from vllmfit.operator import builders
from vllmfit.operator.state import get_store

QWEN7 = "Qwen/Qwen2.5-7B-Instruct"
BIG = {"maxModelLen": 32768, "kvCache": {"concurrency": 16}}  # more than half of an H100's budget
GRACE = 0.2


def scenario(cluster: Cluster, kubelet: Kubelet) -> list[tuple[str, Callable[[], Awaitable[Any]], Callable[[], bool]]]:
    def dep(name: str) -> bool:
        return cluster.get(DEPLOYMENTS, name) is not None

    async def move_b() -> None:
        here = int(placed(cluster, "b")[0].split(":")[1])
        moved["to"] = f"gpu-a:{1 - here}"
        await cluster.patch_spec("b", {"placement": {"nodeName": "gpu-a", "gpuIndices": [1 - here]}})

    moved: dict[str, str] = {}
    return [
        ("node", lambda: cluster.create(node("gpu-a", gpus=2)), lambda: True),
        ("create a (2 replicas)", lambda: cluster.create(vd("a", QWEN7, replicas=2, **BIG)),
         lambda: phase(cluster, "a") == "Admitted" and dep("a-0") and dep("a-1")),
        ("create b (no room)", lambda: cluster.create(vd("b", QWEN7, **BIG)),
         lambda: phase(cluster, "b") == "Unschedulable"),
        ("scale a to 1", lambda: cluster.patch_spec("a", {"replicas": 1}),
         lambda: len(placed(cluster, "a")) == 1 and not dep("a-1") and phase(cluster, "b") == "Admitted"
         and dep("b-0")),
        ("delete a", lambda: cluster.delete("a"), lambda: not exists(cluster, "a") and not dep("a-0")
         and not any(p.owner == "a" for p in kubelet.pods.values()) and not get_store().drains),  # room to move to
        ("move b", move_b, lambda: placed(cluster, "b") == [moved.get("to")] and dep("b-0")
         and cluster.get(DEPLOYMENTS, "b-0")["metadata"]["annotations"]["vllmfit.dev/placement"] == moved["to"]),
        ("lose the node", lambda: cluster.delete_node("gpu-a"),
         lambda: phase(cluster, "b") == "Unschedulable" and not dep("b-0")),
        ("the node comes back", lambda: cluster.create(node("gpu-a", gpus=2)),
         lambda: phase(cluster, "b") == "Admitted" and dep("b-0")),
        ("create and delete c", lambda: create_delete(cluster, "c"),
         lambda: not exists(cluster, "c") and not dep("c-0")),
        ("delete b", lambda: cluster.delete("b"), lambda: not exists(cluster, "b") and not dep("b-0")),
    ]


def covered(cluster: Cluster, where: str) -> None:
    """Every Deployment vllmfit owns is covered by the stored admitted booking of its (existing)
    VLLMDeployment at the place it runs. One whose VLLMDeployment is gone (deleted before the
    operator stopped its Deployment) is not: the sweep deletes it at start-up and its pods are
    drains until they are gone, which the kubelet's invariant checks."""
    live = {o["metadata"]["name"]: o.get("status") or {} for o in cluster.objects(VD)}
    for d in cluster.objects(DEPLOYMENTS):
        labels = d["metadata"].get("labels") or {}
        owner = labels.get(builders.LABEL_DEPLOYMENT)
        if labels.get(builders.MANAGED_BY) != "vllmfit" or owner not in live:
            continue
        st = live[owner]
        here = d["metadata"]["annotations"][builders.ANNOTATION_PLACEMENT]
        assert st.get("phase") in ("Admitted", "Running", "Failed"), \
            f"{where}: Deployment {d['metadata']['name']} runs, but {owner} has no admitted booking"
        assert here in placed(cluster, owner), f"{where}: {d['metadata']['name']} runs on {here}, booked " \
                                               f"{placed(cluster, owner)}"


async def create_delete(cluster: Cluster, name: str) -> None:
    await cluster.create(vd(name, QWEN7, maxModelLen=4096))
    await asyncio.sleep(0.05)
    await cluster.delete(name)


async def run(km: Crashing, kill_at: int | None) -> int:
    """The scenario with a crash at the operator's `kill_at`-th write; returns the writes seen."""
    km.kill_at, km.writes = kill_at, 0
    km.killed, km.thaw = asyncio.Event(), asyncio.Event()
    cluster = Cluster(km)
    kubelet = Kubelet(Cluster(km), grace=GRACE, gpus={"gpu-a": 2})
    op = Operator(km)
    await op.start()
    kubelet.start()
    crashed = False
    trace: list[str] = []
    try:
        for what, action, done in scenario(cluster, kubelet):
            await action()
            trace.append(f"--- {what}")
            deadline = asyncio.get_running_loop().time() + 20
            while not done():
                kubelet.assert_ok(f"crash at write {kill_at}, during {what}")
                seen = (cluster.phases(), [placed(cluster, n) for n in ("a", "b")],
                        sorted(d["metadata"]["name"] for d in cluster.objects(DEPLOYMENTS)))
                if not trace or trace[-1] != repr(seen):
                    trace.append(repr(seen))
                if asyncio.get_running_loop().time() > deadline:
                    print("\n".join(trace))
                    pytest.fail(f"crash at write {kill_at}: {what} never done; phases {cluster.phases()}, "
                                f"placed {[placed(cluster, n) for n in ('a', 'b')]}, "
                                f"Deployments {[d['metadata']['name'] for d in cluster.objects(DEPLOYMENTS)]}")
                if km.killed.is_set() and not crashed:
                    crashed = True
                    trace.append("=== crash")
                    await asyncio.sleep(0.05)  # let in-flight requests reach the frozen emulator
                    await op.stop()
                    covered(cluster, f"crash at write {kill_at} ({what})")
                    await km.restart(op, cluster)
                    await kubelet.ensure()
                    continue
                await asyncio.sleep(0.01)
            kubelet.assert_ok(f"crash at write {kill_at}, after {what}")
        await get_store().flush()
        kubelet.assert_ok(f"settled, crash at write {kill_at}")
        return km.writes
    finally:
        km.thaw.set()
        await kubelet.stop()
        await op.stop()
        await cluster.api.close()


@pytest.fixture
async def crashing() -> Any:
    async with Crashing() as km, kmock.Server(km):
        km.resources.load_bundled()
        km.resources[VD] = kmock.ResourceInfo(
            kind=api.KIND, namespaced=True, singular=api.SINGULAR, shortnames=set(api.SHORT_NAMES),
            subresources={"status"}, verbs={"get", "list", "watch", "create", "patch", "update", "delete"})
        yield km


async def test_no_crash_the_lifecycle_scenario_holds_the_invariant(crashing: Crashing) -> None:
    assert await run(crashing, None) > 10


@pytest.mark.skipif(not os.environ.get("VLLMFIT_CRASH_LIFECYCLE"), reason=(
    "set VLLMFIT_CRASH_LIFECYCLE=1 to run it (2-6 min): under load a few kill points (node loss, "
    "delete) sometimes miss the 20 s step deadline; no run has broken the GPU invariant"))
async def test_a_crash_at_any_write_of_the_lifecycle_keeps_every_gpu_within_budget(crashing: Crashing) -> None:
    n = await run(crashing, None)
    # every 3rd write by default (about 20 of its ~60 writes, a minute on two cores);
    # VLLMFIT_CRASH_STEP=1 tries every write (as tests/operator/test_crash.py does)
    step = max(1, int(os.environ.get("VLLMFIT_CRASH_STEP", "3")))
    only = os.environ.get("VLLMFIT_CRASH_AT")  # one kill point, to look at it
    for k in ([int(only)] if only else range(0, n, step)):
        async with Crashing() as km, kmock.Server(km):
            km.resources.load_bundled()
            km.resources[VD] = crashing.resources[VD]
            await asyncio.wait_for(run(km, k), 90)
