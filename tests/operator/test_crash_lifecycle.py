"""Kill the operator at its writes while replicas stop and start (issue 22, item 5): scale-down,
delete, move, node loss and re-creation, a resize in place that frees room a newcomer waits for,
create + delete, a delete that lands while the
operator writes the booking, with pods that take `GRACE` seconds to terminate
(tests/operator/kubelet.py plays the ReplicaSet controller and the kubelet). Invariants, at
every instant of every run, crash and restart included:
- for every GPU, the sum over every pod that may be running on it (terminating ones too) is
  within its budget, each pod holding what the stored status booked for it when it started;
- no pod starts, and no Deployment is written, where no stored status books its replica (the
  emulator checks each Deployment the operator writes against the statuses the API stored; a
  status write answered 404 stored nothing);
- at the crash instant, every Deployment vllmfit owns is covered by a stored admitted booking.
And each scenario step is done within `STEP_DEADLINE_S` (nothing stuck Admitted on a lost node,
no drain that never ends).

In the suite (`kill_points`): the write right after each status write, about 25 of the ~95
writes, each step's included. VLLMFIT_CRASH_STEP=k kills at every k-th write (1: at
every write), VLLMFIT_CRASH_AT=k at one.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import kmock
import pytest
from crashing import Crashing
from kubelet import Kubelet, exists, phase, placed, placement_of
from opkit import DEPLOYMENTS, PODS, TEST_AGENT, VD, Cluster, Operator, node, vd

from vllmfit.core.spec import api
from vllmfit.operator.booking.state import Options
from vllmfit.operator.rendering import builders

pytestmark = pytest.mark.looptime  # hang guards and waits in virtual seconds (issue 29): no wall time

QWEN7 = "Qwen/Qwen2.5-7B-Instruct"
BIG = {"maxModelLen": 32768, "kvCache": {"concurrency": 16}}  # more than half of an H100's budget
GRACE = 0.2
BOOKED = ("Admitted", "Running", "Failed")  # phases whose status books its placement (as kubelet.booked)
RESYNC_S = Options().resync_seconds
"""The operator's periodic resync (core.defaults.RESYNC_SECONDS, 30 s): it repairs
what the events missed (a write that failed, a node lost while no operator ran)."""
STEP_DEADLINE_S = RESYNC_S
"""A step is done once the events it causes are handled or, at the latest, after the next resync:
one resync period after the step began. Every step took under 2 s on a loaded 2-core machine; a
step still not done after a whole period is stuck (a liveness failure, reported with a trace)."""
STOP_DEADLINE_S = RESYNC_S
"""Bounds a kill, a restart or the teardown of the operator and the kubelet (a hang guard: the
operator's stop cancels its tasks and waits for them)."""
KILL_EVERY = os.environ.get("VLLMFIT_CRASH_STEP")  # every k-th write instead (1: every write)
KILL_AT = os.environ.get("VLLMFIT_CRASH_AT")  # one kill point, to look at it
RES_VD, RES_DEPLOYMENTS, RES_PODS = kmock.resource(VD), kmock.resource(DEPLOYMENTS), kmock.resource(PODS)

Step = tuple[str, Callable[[], Awaitable[Any]], Callable[[], bool]]


@attrs.define(kw_only=True)
class Racing(Crashing):
    """Crashing, and what reached the store: the status each VLLMDeployment's last successful
    status write left (`stored`; a write answered 404 stored nothing), every Deployment the
    operator wrote that no stored status booked at that instant (`unbooked`: its ReplicaSet would
    start a pod that holds memory nothing books), and `race`: a user's action that lands just
    before the operator's first write of a booking for that VLLMDeployment reaches the store."""

    stored: dict[str, dict[str, Any]] = attrs.field(factory=dict)  # "ns/name" -> stored status
    unbooked: list[str] = attrs.field(factory=list)
    race: dict[str, Callable[[], Awaitable[Any]]] = attrs.field(factory=dict)  # name -> the user's action
    raced: dict[str, int] = attrs.field(factory=dict)  # name -> the HTTP status its booking write got
    after_pod_listing: Callable[[], Awaitable[Any]] | None = None  # once, after the operator's next pod listing
    status_writes: list[int] = attrs.field(factory=list)  # the operator's write numbers of its status writes
    kill_after_status: int | None = None  # crash at the operator's first write after its n-th status write

    def _raw(self, resource: Any, ns: str | None, name: str | None) -> dict[str, Any] | None:
        key = (resource, ns, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return self.objects[key].raw

    async def serve(self, request: Any) -> Any:
        ours = request.headers.get("User-Agent") != TEST_AGENT
        method = str(request.method).upper().split(".")[-1]
        status_write = method == "PATCH" and request.resource == RES_VD and request.subresource == "status"
        name, ns = request.name, request.namespace
        booking = status_write and ((request.data or {}).get("status") or {}).get("phase") in BOOKED
        if ours and status_write:
            self.status_writes.append(self.writes - 1)  # Crashing counted it
            if len(self.status_writes) == self.kill_after_status:
                self.kill_at = self.writes  # the next one: this status is stored, what it orders is not
        racing = ours and booking and name in self.race and name not in self.raced
        if racing:
            self.raced[name] = 0
            await self.race[name]()
        try:
            response = await super().serve(request)
        except Exception as e:
            if racing:
                self.raced[name] = int(getattr(e, "status", 500))
            raise
        if racing:
            self.raced[name] = 200
        if ours and request.action == kmock.action.LIST and request.resource == RES_PODS and self.after_pod_listing:
            then, self.after_pod_listing = self.after_pod_listing, None
            await then()
        if status_write:
            obj = self._raw(RES_VD, ns, name)
            if obj is not None:
                self.stored[f"{ns}/{name}"] = dict(obj.get("status") or {})
        elif ours and method in ("POST", "PATCH") and request.resource == RES_DEPLOYMENTS:
            if method == "POST":
                name = ((request.data or {}).get("metadata") or {}).get("name")
            self.check_deployment(ns, name)
        return response

    def check_deployment(self, ns: str | None, name: str | None) -> None:
        d = self._raw(RES_DEPLOYMENTS, ns, name)
        tmpl = ((d or {}).get("spec") or {}).get("template", {}).get("metadata") or {}
        labels = tmpl.get("labels") or {}
        if labels.get(builders.MANAGED_BY) != "vllmfit":
            return
        owner, replica = f"{ns}/{labels[builders.LABEL_DEPLOYMENT]}", int(labels[builders.LABEL_REPLICA])
        where = (tmpl.get("annotations") or {}).get(builders.ANNOTATION_PLACEMENT)
        st = self.stored.get(owner) or {}
        places = [f"{p['replica']}@{placement_of(p)}"
                  for p in st.get("placement") or []] if st.get("phase") in BOOKED else []
        if f"{replica}@{where}" not in places:
            self.unbooked.append(f"Deployment {name} written on {where} while the stored status of {owner} "
                                 f"books {places or 'nothing'} ({st.get('phase')})")


class StoredKubelet(Kubelet):
    """The kubelet, reading the last booking of a VLLMDeployment deleted before it looked from
    what the API stored (Kubelet.last_written also takes a status write answered 404)."""

    def last_written(self, owner: str) -> dict[str, Any]:
        return dict(self.cluster.km.stored.get(f"default/{owner}") or {})


def scenario(cluster: Cluster, kubelet: Kubelet, km: Racing) -> list[Step]:
    def dep(name: str) -> bool:
        return cluster.get(DEPLOYMENTS, name) is not None

    async def move_b() -> None:
        here = int(placed(cluster, "b")[0].split(":")[1])
        moved["to"] = f"gpu-a:{1 - here}"
        # allowReschedule false: b stays on that GPU from now on (the resize below is in place)
        await cluster.patch_spec("b", {"placement": {"nodeName": "gpu-a", "gpuIndices": [1 - here],
                                                      "allowReschedule": False}})

    def gpu_of_b() -> int:
        return int(placed(cluster, "b")[0].split(":")[1])

    async def f_waits_for_b() -> None:
        resized["on"] = placed(cluster, "b")[0]
        await cluster.create(vd("f", QWEN7, placement={"nodeName": "gpu-a", "gpuIndices": [gpu_of_b()],
                                                                 "allowReschedule": False}, **BIG))

    async def deleted_while_booked(name: str) -> None:
        km.race[name] = lambda: cluster.delete(name)  # lands before the operator's booking is stored
        await cluster.create(vd(name, QWEN7, maxModelLen=4096))

    moved: dict[str, str] = {}
    resized: dict[str, str] = {}
    return [
        ("node", lambda: cluster.create(node("gpu-a", gpus=2)), lambda: True),
        ("create a (2 replicas)", lambda: cluster.create(vd("a", QWEN7, replicas=2, **BIG)),
         lambda: phase(cluster, "a") == "Admitted" and dep("a-0") and dep("a-1")),
        ("create b (no room)", lambda: cluster.create(vd("b", QWEN7, **BIG)),
         lambda: phase(cluster, "b") == "Unschedulable"),
        ("scale a to 1", lambda: cluster.patch_spec("a", {"replicas": 1}),
         lambda: len(placed(cluster, "a")) == 1 and not dep("a-1") and phase(cluster, "b") == "Admitted"
         and dep("b-0")),
        ("delete a; e waits for its room", lambda: delete_then_create(cluster, "a", vd("e", QWEN7, **BIG)),
         lambda: not exists(cluster, "a") and not dep("a-0") and phase(cluster, "e") == "Admitted" and dep("e-0")),
        ("delete e", lambda: cluster.delete("e"), lambda: not exists(cluster, "e") and not dep("e-0")
         and not any(p.owner == "e" for p in kubelet.pods.values()) and not cluster.store.books.drains),  # room to move to
        ("move b", move_b, lambda: placed(cluster, "b") == [moved.get("to")] and dep("b-0")
         and cluster.get(DEPLOYMENTS, "b-0")["metadata"]["annotations"]["vllmfit.dev/placement"] == moved["to"]),
        ("lose the node", lambda: cluster.delete_node("gpu-a"),
         lambda: phase(cluster, "b") == "Unschedulable" and not dep("b-0")),
        ("the node comes back", lambda: cluster.create(node("gpu-a", gpus=2)),
         lambda: phase(cluster, "b") == "Admitted" and dep("b-0")),
        ("f waits for b's GPU", f_waits_for_b, lambda: phase(cluster, "f") == "Unschedulable"),
        ("resize b in place; f takes the room once b's old pod is gone",
         lambda: cluster.patch_spec("b", {"maxModelLen": 4096, "kvCache": {"concurrency": 1}}),
         lambda: placed(cluster, "b") == [resized["on"]] and (cluster.status("b").get("flags") or {}).get(
             "maxModelLen") == 4096 and phase(cluster, "f") == "Admitted" and dep("f-0")),
        ("create and delete c", lambda: create_delete(cluster, "c"),
         lambda: not exists(cluster, "c") and not dep("c-0")),
        ("d deleted while its booking is written", lambda: deleted_while_booked("d"),
         lambda: "d" in km.raced and not exists(cluster, "d") and not dep("d-0")),
        ("delete b", lambda: cluster.delete("b"), lambda: not exists(cluster, "b") and not dep("b-0")),
        ("delete f", lambda: cluster.delete("f"), lambda: not exists(cluster, "f") and not dep("f-0")),
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
        assert st.get("phase") in BOOKED, \
            f"{where}: Deployment {d['metadata']['name']} runs, but {owner} has no admitted booking"
        assert here in placed(cluster, owner), f"{where}: {d['metadata']['name']} runs on {here}, booked " \
                                               f"{placed(cluster, owner)}"


async def delete_then_create(cluster: Cluster, name: str, obj: dict[str, Any]) -> None:
    """Delete `name`, and at once create a spec that only fits where it ran: the newcomer waits
    until the deleted one's pods are gone."""
    await cluster.delete(name)
    await cluster.create(obj)


async def create_delete(cluster: Cluster, name: str) -> None:
    await cluster.create(vd(name, QWEN7, maxModelLen=4096))
    await asyncio.sleep(0.05)
    await cluster.delete(name)


def assert_ok(km: Racing, kubelet: Kubelet, where: str) -> None:
    if km.unbooked:
        pytest.fail(f"{where}: {km.unbooked[:3]}")
    kubelet.assert_ok(where)


async def halt(kubelet: Kubelet) -> None:
    """kubelet.stop(), cancelling until the loop has ended: one cancel() did not end it while
    Kubelet._loop used asyncio.wait_for, which on Python 3.11 swallows a cancellation that
    arrives as the step it waits for finishes (Kopf's stop, which cancels every task started
    while the operator ran, then waited for it forever)."""
    task = kubelet.task
    while task is not None and not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=0.1)
    await kubelet.stop()


async def run(km: Racing, kill_at: int | None) -> int:
    """The scenario with a crash at the operator's `kill_at`-th write (or after its
    `km.kill_after_status`-th status write); returns the writes seen."""
    km.kill_at, km.writes = kill_at, 0
    at = f"at write {kill_at}" if kill_at is not None else \
        f"after status write {km.kill_after_status}" if km.kill_after_status else "none (the run without one)"
    km.killed, km.thaw = asyncio.Event(), asyncio.Event()
    cluster = Cluster(km)
    kubelet = StoredKubelet(Cluster(km), grace=GRACE, gpus={"gpu-a": 2})
    op = Operator(km)
    await op.start()
    kubelet.start()
    crashed = False
    loop = asyncio.get_running_loop()
    trace: list[str] = []

    def note(line: str) -> None:
        if not trace or not trace[-1].endswith(line):
            trace.append(f"{loop.time():9.3f} {line}")

    try:
        for what, action, done in scenario(cluster, kubelet, km):
            await action()
            note(f"--- {what}")
            deadline = loop.time() + STEP_DEADLINE_S
            while not done():
                assert_ok(km, kubelet, f"crash {at}, during {what}")
                note(repr((cluster.phases(), [placed(cluster, n) for n in ("a", "b")],
                           sorted(d["metadata"]["name"] for d in cluster.objects(DEPLOYMENTS)),
                           sorted(cluster.store.books.drains))))
                if loop.time() > deadline:
                    print("\n".join(trace))
                    pytest.fail(f"crash {at}: {what} not done within {STEP_DEADLINE_S:g} s (one "
                                f"resync period); phases {cluster.phases()}, placed "
                                f"{[placed(cluster, n) for n in ('a', 'b')]}, Deployments "
                                f"{[d['metadata']['name'] for d in cluster.objects(DEPLOYMENTS)]}, drains "
                                f"{sorted(cluster.store.books.drains)}, pods {sorted(kubelet.pods)}")
                if km.killed.is_set() and not crashed:
                    crashed = True
                    if kill_at is None:
                        at = f"at write {km.kill_at} ({at})"
                    note("=== crash")
                    await asyncio.sleep(0.05)  # let in-flight requests reach the frozen emulator
                    async with asyncio.timeout(STOP_DEADLINE_S):
                        await halt(kubelet)  # Kopf's stop would cancel it (and wait for it)
                        await km.kill(op)
                    covered(cluster, f"crash {at} ({what})")
                    async with asyncio.timeout(STOP_DEADLINE_S):
                        await km.restart(op, cluster)
                        await kubelet.ensure()
                    note("=== restarted")
                    deadline = loop.time() + STEP_DEADLINE_S  # a new operator, from its start-up
                    continue
                await asyncio.sleep(0.01)
            assert_ok(km, kubelet, f"crash {at}, after {what}")
        await cluster.store.writer.flush()
        assert_ok(km, kubelet, f"settled, crash {at}")
        return km.writes
    finally:
        km.thaw.set()
        async with asyncio.timeout(STOP_DEADLINE_S):
            await halt(kubelet)
            await op.stop()
        await cluster.api.close()


@pytest.fixture
async def racing() -> Any:
    async with Racing() as km, kmock.Server(km):
        declare(km)
        yield km


def declare(km: Racing) -> None:
    km.resources.load_bundled()
    km.resources[VD] = kmock.ResourceInfo(
        kind=api.KIND, namespaced=True, singular=api.SINGULAR, shortnames=set(api.SHORT_NAMES),
        subresources={"status"}, verbs={"get", "list", "watch", "create", "patch", "update", "delete"})


async def test_no_crash_the_lifecycle_scenario_holds_the_invariant(racing: Racing) -> None:
    assert await run(racing, None) > 10
    # the user's delete of d landed just before its booking was stored. On the virtual clock the
    # run is fixed: Kopf's finalizer is on d by then, so the delete only marks it and the booking's
    # write succeeds (200); the operator then releases what it booked. (On the real clock the
    # order varied with the machine: d could still lack its finalizer, and the write was answered
    # 404; that path is test_lifecycle's test_a_booking_whose_status_cannot_be_written_because_
    # the_object_is_gone_starts_nothing.)
    assert racing.raced == {"d": 200}


def kill_points(n: int, status_writes: list[int]) -> list[tuple[int | None, int | None]]:
    """(kill at write k, kill after status write m). In the suite: right after each status write
    of the run without a crash, counted in the run itself (the writes around it come in another
    order from run to run): a crash there leaves that status stored and what it orders undone
    (the stop after a release, the start after a booking). Every step writes a status, so each
    is killed at least once. VLLMFIT_CRASH_STEP=k: every k-th of the `n` writes instead."""
    if KILL_AT:
        return [(int(KILL_AT), None)]
    if KILL_EVERY:
        return [(k, None) for k in range(0, n, max(1, int(KILL_EVERY)))]
    return [(None, m) for m in range(1, len(status_writes) + 1)]


async def test_a_crash_at_the_writes_of_the_lifecycle_keeps_every_gpu_within_budget(racing: Racing) -> None:
    n = await run(racing, None)
    for k, m in kill_points(n, racing.status_writes):
        async with Racing(kill_after_status=m) as km, kmock.Server(km):  # the same scenario from an empty cluster
            declare(km)
            await run(km, k)


async def test_a_pod_that_leaves_before_the_pods_watch_lists_frees_its_memory_without_the_resync(
        racing: Racing, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod of vllmfit that nothing books at start-up is a drain charged with its GPUs' room until
    it is gone. One that leaves the API after the start-up listing and before the pods watch's
    first listing sends no event (the watch never saw it). Its drain ends at the first node event
    after that listing, not at the next resync (off here: nothing else would end it). Before,
    a newcomer waited for the resync (kill points 42-43 of the lifecycle above, under load)."""
    cluster = Cluster(racing)
    await cluster.create(node("gpu-a", gpus=1))
    name = "gone-0-abcde"  # replica 0 of a VLLMDeployment deleted while no operator ran
    await cluster.create({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": "u-1", "resourceVersion": "1",
                     "labels": {builders.MANAGED_BY: "vllmfit", builders.LABEL_DEPLOYMENT: "gone",
                                builders.LABEL_REPLICA: "0"},
                     "annotations": {builders.ANNOTATION_PLACEMENT: "gpu-a:0"},
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "gone-0-x",
                                          "uid": "u-2", "controller": True}]},
        "spec": {"nodeName": "gpu-a", "containers": [{"name": "vllm", "image": "vllm"}]},
        "status": {"phase": "Running"}})
    racing.after_pod_listing = lambda: cluster.core.delete_namespaced_pod(name, "default")
    op = Operator(racing, options=Options(resync_seconds=0))
    await op.start()
    try:
        assert racing.after_pod_listing is None  # the start-up listed the pod; it is gone now
        await cluster.create(vd("b", QWEN7, **BIG))
        try:
            await cluster.phase("b", "Admitted", timeout=STEP_DEADLINE_S)
        except AssertionError:
            pytest.fail(f"b stays {phase(cluster, 'b')}: {cluster.status('b').get('reasons')}; drains "
                        f"{sorted(cluster.store.books.drains)}")
        assert not cluster.store.books.drains
    finally:
        await op.stop()
        await cluster.api.close()
