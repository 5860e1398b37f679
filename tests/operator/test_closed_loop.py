"""The closed loop on the emulator (issue 34): what the agent measures corrects the ledger, gates
every start, and teaches the prediction.

The test plays the node agent: it writes the `vllmfit.dev/gpu-inventory` annotation (a process per
replica pod, by pod UID, as the agent's cgroup attribution reports it) with `sampledAt` times of
its choosing, and the ReplicaSet controller / kubelet (the replica pods, Ready or not). Nothing
waits on a timer: "one agent interval" is two consecutive inventories, and staleness is the
`sampledAt` the test writes, against the operator's clock."""

from __future__ import annotations

import json
import math
import uuid as uuidlib
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from opkit import DEPLOYMENTS, H100, Cluster, Operator, node, vd
from reservationkit import DevicePlugin, U, gates, replica_pod

from vllmfit import main as cli_main
from vllmfit.core import defaults, memory
from vllmfit.core.defaults import GIB, MIB
from vllmfit.sources import catalog

pytestmark = pytest.mark.looptime  # hang guards and waits in virtual seconds (issue 29): no wall time

QWEN7 = "Qwen/Qwen2.5-7B-Instruct"
CAPACITY = 81559 * MIB  # what NVML reports as an H100 80GB's total
BUDGET = math.ceil(0.90 * catalog.gpu(H100).cuda_total_bytes) + int(0.55 * GIB)  # counted (the default), by hand:
# what one vLLM at u 0.9 uses on an empty GPU, its CUDA context included
MARGIN = defaults.OBSERVED_MARGIN_BYTES
def stamp(seconds: float = 0) -> str:
    """A sampledAt `seconds` from now (the operator judges ages against its own clock)."""
    return (datetime.now(UTC) + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def inventory(gpus: int, procs: dict[int, list[tuple[str, int]]] | None = None, foreign: dict[int, int] | None = None,
              at: str | None = None) -> dict[str, str]:
    """The agent's annotation: GPU i runs `procs[i]` ((pod UID, bytes) each) and `foreign[i]` bytes
    of something that is not vllmfit's (a process of another pod)."""
    procs, foreign = procs or {}, foreign or {}
    out = []
    for i in range(gpus):
        ps = [{"pid": 100 * i + k, "used_bytes": n, "pod_uid": uid} for k, (uid, n) in enumerate(procs.get(i, []))]
        if foreign.get(i):
            ps.append({"pid": 100 * i + 99, "used_bytes": foreign[i], "pod_uid": "someone-elses-pod"})
        out.append({"index": i, "uuid": U[i], "product": H100, "total_bytes": CAPACITY,
                    "used_bytes": sum(p["used_bytes"] for p in ps), "processes": ps})
    return {defaults.INVENTORY_ANNOTATION: json.dumps({"sampled_at": at or stamp(), "nvml": True, "gpus": out})}


async def agent(cluster: Cluster, name: str, gpus: int, procs: dict[int, list[tuple[str, int]]] | None = None,
                foreign: dict[int, int] | None = None, at: str | None = None) -> None:
    await cluster.patch_node(name, {"metadata": {"annotations": inventory(gpus, procs, foreign, at)}})


async def pod(cluster: Cluster, deployment: str, *, ready: bool, replica: int = 0) -> str:
    """A replica's running pod (what the kubelet reports): returns its UID."""
    uid = str(uuidlib.uuid4())
    labels = {defaults.DEPLOYMENT_LABEL: deployment, "vllmfit.dev/replica": str(replica),
              defaults.MANAGED_BY_LABEL: defaults.MANAGED_BY}
    await cluster.create({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": f"{deployment}-{replica}-{uid[:5]}", "namespace": "default", "uid": uid, "resourceVersion": "1",
        "labels": labels}, "status": {"phase": "Running", "containerStatuses": [{
            "name": "vllm", "image": defaults.DEFAULT_IMAGE, "imageID": "", "ready": ready, "restartCount": 0,
            "state": {"running": {}}}]}})
    await cluster.until(lambda: uid in cluster.store.cache.managed_pods(), what=f"the operator to see {deployment}'s pod")
    return uid


def mem(cluster: Cluster, name: str) -> dict[str, Any]:
    [m] = cluster.status(name)["memory"]
    return m


def condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), None)


FIXED = {"maxModelLen": 8192, "maxNumSeqs": 256, "maxNumBatchedTokens": 8192}
"""Every setting the search may lower to fit is set: a footprint is its non-KV part + the KV request."""


def kv(n: int) -> dict[str, Any]:
    return {"memory": str(n)}


@pytest.mark.parametrize("over", [0, 2 * GIB])
async def test_a_replica_using_2_gib_more_grows_its_booking_and_a_newcomer_that_fit_the_prediction_waits(
        cluster: Cluster, operator: Operator, over: int) -> None:
    await cluster.create(node("gpu-a", gpus=1, annotations=inventory(1)))
    await cluster.create(vd("a", QWEN7, kvCache=kv(20 * GIB), **FIXED))
    await cluster.phase("a", "Admitted")
    predicted = mem(cluster, "a")["totalBytes"]
    headroom = BUDGET - predicted
    assert cluster.status("a")["gpus"][0]["headroomBytes"] == headroom
    # b: the same model with a KV cache that leaves 1 GiB of the headroom a's prediction leaves
    # (a footprint is its non-KV part + the KV request, rounded up to u's 4 decimals: < 8 MiB)
    non_kv = predicted - 20 * GIB
    b_kv = headroom - non_kv - GIB
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0"), what="a's Deployment")
    template = cluster.get(DEPLOYMENTS, "a-0")["spec"]["template"]
    uid = await pod(cluster, "a", ready=True)
    await agent(cluster, "gpu-a", 1, {0: [(uid, predicted + over)]})
    # within one agent interval (the first inventory after a Ready pod): booked observed + margin
    want = predicted + over + MARGIN
    await cluster.until(lambda: mem(cluster, "a")["totalBytes"] == want, what="a's booking to grow")
    await cluster.store.writer.flush()
    assert cluster.get(DEPLOYMENTS, "a-0")["spec"]["template"] == template  # the measured vLLM is not restarted
    assert mem(cluster, "a")["observedExcessBytes"] == over + MARGIN
    assert cluster.store.books.ledger.headroom_bytes("gpu-a", 0) == headroom - over - MARGIN
    await cluster.create(vd("b", QWEN7, kvCache=kv(b_kv), **FIXED))
    if over == 0:  # the control: on the prediction (+ the margin) b shares the GPU
        await cluster.phase("b", "Admitted")
        assert mem(cluster, "b")["totalBytes"] <= headroom - MARGIN
        return
    st = await cluster.phase("b", "Unschedulable")
    assert headroom - over - MARGIN < mem_alone(b_kv, non_kv) <= headroom  # it would have fitted on the prediction
    assert "gpu-a" in " ".join(st["reasons"])
    assert cluster.store.books.ledger.over_budget() == []  # a's growth fitted the budget; nothing moved
    # a second node: b is placed there, a stays where it is
    await cluster.create(node("gpu-b", gpus=1, annotations=inventory(1)))
    st = await cluster.phase("b", "Admitted")
    assert st["node"] == "gpu-b" and cluster.status("a")["node"] == "gpu-a"


def mem_alone(kv_bytes: int, non_kv: int) -> int:
    return non_kv + kv_bytes


async def test_without_readiness_two_stable_samples_start_the_replica_one_interval_later(
        cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=1, annotations=inventory(1)))
    await cluster.create(vd("a", QWEN7, maxModelLen=8192))
    await cluster.phase("a", "Admitted")
    predicted = mem(cluster, "a")["totalBytes"]
    uid = await pod(cluster, "a", ready=False)  # still loading: not Ready
    used = predicted + 2 * GIB
    await agent(cluster, "gpu-a", 1, {0: [(uid, used - GIB)]}, at=stamp(0))  # still growing
    await agent(cluster, "gpu-a", 1, {0: [(uid, used)]}, at=stamp(30))  # grew by 1 GiB: not stable yet
    await cluster.store.writer.flush()
    assert mem(cluster, "a")["totalBytes"] == predicted and ("default/a", 0) not in cluster.store.cache.started
    await agent(cluster, "gpu-a", 1, {0: [(uid, used + 10 * MIB)]}, at=stamp(60))  # within 64 MiB: stable
    await cluster.until(lambda: mem(cluster, "a")["totalBytes"] == used + 10 * MIB + MARGIN,
                        what="a's booking to grow one agent interval after its footprint stopped moving")
    event = await cluster.event("a", "BookingGrew")
    assert "gpu-a GPU 0 replica 0" in event["message"]
    # a smaller observed footprint later never shrinks the booking below the prediction
    await agent(cluster, "gpu-a", 1, {0: [(uid, predicted // 2)]}, at=stamp(90))
    await cluster.until(lambda: mem(cluster, "a")["totalBytes"] == predicted, what="the floor")
    assert mem(cluster, "a").get("observedExcessBytes") is None


async def shared_on_gpu_1(cluster: Cluster, at: str) -> None:
    """a and b admitted on gpu-a GPU 1 of two (shared: reservation + gate), their Deployments written."""
    await cluster.create(node("gpu-a", gpus=2, annotations=inventory(2, at=at)))
    pin = {"nodeName": "gpu-a", "gpuIndices": [1]}
    await cluster.create(vd("a", QWEN7, maxModelLen=8192, placement=pin))
    await cluster.create(vd("b", QWEN7, maxModelLen=8192, placement=pin))
    await cluster.phase("a", "Admitted")
    await cluster.phase("b", "Admitted")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0") and cluster.get(DEPLOYMENTS, "b-0"))


async def shared(cluster: Cluster, at: str) -> tuple[str, str]:
    """shared_on_gpu_1, and the pods of a-0 and b-0, both behind the gate."""
    await shared_on_gpu_1(cluster, at)
    pod_a, pod_b = await replica_pod(cluster, "a-0"), await replica_pod(cluster, "b-0")
    await cluster.until(lambda: {("default", pod_a), ("default", pod_b)} <= set(cluster.store.cache.gate_of),
                        what="both pods behind the gate")
    return pod_a, pod_b


async def test_a_stale_agent_holds_the_start_gate_and_says_so(cluster: Cluster, operator: Operator) -> None:
    # the agent last published 200 s ago: the ledger still reads that inventory (it is stale after
    # INVENTORY_STALE_SECONDS), the start gate does not trust it (START_GATE_MAX_AGE_SECONDS)
    assert defaults.START_GATE_MAX_AGE_SECONDS < 200 < defaults.INVENTORY_STALE_SECONDS
    pod_a, pod_b = await shared(cluster, at=stamp(-200))
    assert await DevicePlugin(cluster, {"gpu-a": U[:2]}, order={"gpu-a": [1, 0]}).serve() == [U[1]]
    await cluster.until(lambda: condition(cluster.status("a"), "StartGate"), what="the StartGate condition")
    c = condition(cluster.status("a"), "StartGate")
    assert c["status"] == "False" and "s old (more than 90 s)" in c["message"]
    assert gates(cluster, pod_a) and gates(cluster, pod_b)  # the reservation is held, the gate is not lifted
    event = await cluster.event("a", "StartHeld")
    assert "waiting for a fresh one" in event["message"]
    await agent(cluster, "gpu-a", 2)  # the agent is back
    await cluster.until(lambda: not gates(cluster, pod_a) and not gates(cluster, pod_b), what="the gates lifted")
    await cluster.until(lambda: condition(cluster.status("a"), "StartGate")["status"] == "True")


async def test_nothing_starts_on_a_gpu_whose_measured_free_memory_is_below_its_footprint(
        cluster: Cluster, operator: Operator) -> None:
    """a starts first and, still loading (not Ready, not stable), already holds far more than its
    booking: the ledger cannot know yet, the agent does. b's pod, made now, is held by the start
    gate until the agent shows room for it."""
    await shared_on_gpu_1(cluster, stamp())
    pod_a = await replica_pod(cluster, "a-0")
    assert await DevicePlugin(cluster, {"gpu-a": U[:2]}, order={"gpu-a": [1, 0]}).serve() == [U[1]]
    await cluster.until(lambda: not gates(cluster, pod_a), what="a released: the GPU is empty")
    st = cluster.store
    t_a = st.books.ledger.bookings_of("default/a")[0].footprint.total
    t_b = st.books.ledger.bookings_of("default/b")[0].footprint.total
    uid = await pod(cluster, "a", ready=False)
    loading = CAPACITY - t_b + GIB - t_a  # what a holds beyond its booking while it loads
    await agent(cluster, "gpu-a", 2, {1: [(uid, t_a + loading)]}, at=stamp(0))
    await st.writer.flush()
    assert st.books.ledger.bookings_of("default/a")[0].footprint.total == t_a  # not started: the ledger waits
    pod_b = await replica_pod(cluster, "b-0")
    await cluster.until(lambda: ("default", pod_b) in st.cache.gate_holds, what="b held by the start gate")
    assert gates(cluster, pod_b)
    c = await cluster.until(lambda: condition(cluster.status("b"), "StartGate"), what="b's StartGate condition")
    assert c["status"] == "False"
    assert f"gpu-a GPU 1 has {memory.fmt_gib(t_b - GIB)} free (agent), this replica needs {memory.fmt_gib(t_b)}" \
        in c["message"]
    # a settles at its prediction: b is released once the agent shows the room
    await agent(cluster, "gpu-a", 2, {1: [(uid, t_a)]}, at=stamp(60))
    await cluster.until(lambda: not gates(cluster, pod_b), what="b released on measured room")
    assert CAPACITY - t_a >= t_b


async def test_a_gpu_over_budget_names_who_holds_what_and_takes_no_newcomer_until_back_within(
        cluster: Cluster, operator: Operator) -> None:
    """a (Ready) uses far more than predicted: with b beside it, its GPU is over budget. b has not
    started and has nowhere else to go: it stays (behind the start gate); a newcomer waits; a
    foreign process appearing after admission adds to it; once a is back down both go."""
    FULL = {0: BUDGET - 10 * GIB}  # another workload fills gpu-z: nothing goes there
    await cluster.create(node("gpu-z", gpus=1, annotations=inventory(1, foreign=FULL)))
    await cluster.create(node("gpu-a", gpus=1, annotations=inventory(1)))
    await cluster.create(vd("a", QWEN7, **FIXED))
    await cluster.create(vd("b", QWEN7, **FIXED))
    await cluster.phase("a", "Admitted")
    await cluster.phase("b", "Admitted")
    st = cluster.store
    predicted = mem(cluster, "a")["totalBytes"]
    assert mem(cluster, "b")["totalBytes"] == predicted
    uid = await pod(cluster, "a", ready=True)
    over = BUDGET - 2 * predicted + GIB  # a + b booked exceed the budget by 1 GiB + the margin
    await agent(cluster, "gpu-a", 1, {0: [(uid, predicted + over)]}, foreign={0: GIB // 2}, at=stamp(0))
    await cluster.until(lambda: (condition(cluster.status("b"), "OverBudget") or {}).get("status") == "True",
                        what="b's OverBudget condition")
    await cluster.until(lambda: (condition(cluster.status("a"), "OverBudget") or {}).get("status") == "True",
                        what="a's OverBudget condition")  # each deployment's status is its own write
    c = condition(cluster.status("a"), "OverBudget")
    gib = memory.fmt_gib
    assert c["message"] == (
        f"gpu-a GPU 0 is {gib(GIB + MARGIN + GIB // 2)} over its budget of {gib(BUDGET)}: "
        f"default/a replica 0 holds {gib(predicted + over + MARGIN)} (measured {gib(predicted + over)} + margin, "
        f"predicted {gib(predicted)}); default/b replica 0 holds {gib(predicted)} (as predicted); "
        f"others (not vllmfit) hold {gib(GIB // 2)}")
    assert st.books.ledger.over_budget() == [("gpu-a", 0)]
    assert (await cluster.event("b", "GpuOverBudget"))["message"] == c["message"]
    assert cluster.status("b")["phase"] == "Admitted" and cluster.status("b")["node"] == "gpu-a"
    # no newcomer is placed on that GPU while it is over budget
    await cluster.create(vd("c", QWEN7, maxModelLen=2048, kvCache={"concurrency": 1}))
    await cluster.phase("c", "Unschedulable")
    # another node's report says nothing of gpu-a: the conditions stay (they flapped to False and
    # back, an Event each time, with every other node's report)
    await agent(cluster, "gpu-z", 1, {}, foreign=FULL, at=stamp(10))
    await cluster.until(lambda: st.cache.attributions["gpu-z"].sampled_at == stamp(10), what="gpu-z's report")
    await st.writer.flush()
    assert condition(cluster.status("a"), "OverBudget") == c, "another node's report cleared a's OverBudget"
    assert condition(cluster.status("b"), "OverBudget")["status"] == "True"
    # a goes back within its prediction: the GPU is within budget, the conditions say so, c is placed
    await agent(cluster, "gpu-a", 1, {0: [(uid, predicted - GIB)]}, at=stamp(30))
    await cluster.until(lambda: condition(cluster.status("b"), "OverBudget")["status"] == "False")
    assert st.books.ledger.over_budget() == []
    await cluster.phase("c", "Admitted")


async def test_the_second_deployment_of_a_configuration_that_over_ran_is_booked_with_the_observed_figure(
        cluster: Cluster, operator: Operator, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    await cluster.create(node("gpu-a", gpus=1, annotations=inventory(1)))
    spec = {"maxModelLen": 8192, "kvCache": {"concurrency": 1}}
    await cluster.create(vd("first", QWEN7, **spec))
    await cluster.phase("first", "Admitted")
    predicted = mem(cluster, "first")["totalBytes"]
    uid = await pod(cluster, "first", ready=True)
    observed = predicted + 2 * GIB
    await agent(cluster, "gpu-a", 1, {0: [(uid, observed)]})
    await cluster.until(lambda: cluster.store.cache.learned, what="a learned record")
    [rec] = cluster.store.cache.learned
    assert (rec.predicted_bytes, rec.observed_bytes) == (predicted, observed)
    cm = await cluster.until(lambda: next((o for o in cluster.objects("v1/configmaps")
                                           if o["metadata"]["name"] == defaults.CALIBRATION_CONFIGMAP), None),
                             what="the operator's ConfigMap")
    assert cm["metadata"]["labels"][defaults.MANAGED_BY_LABEL] == defaults.MANAGED_BY
    await cluster.create(vd("second", QWEN7, **spec))
    await cluster.phase("second", "Admitted")
    second = mem(cluster, "second")
    assert second["totalBytes"] == observed and second["learnedBytes"] == 2 * GIB
    assert "used 2.0 GiB more at its first start (default/first replica 0 on gpu-a GPU 0; cluster-wide)" in " ".join(
        cluster.status("second").get("warnings") or [])
    # offline: estimate --calibration on the ConfigMap the operator wrote shows the same figure
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(cm))
    rc = cli_main.main(["estimate", "--model", QWEN7, "--max-model-len", "8192", "--kv-concurrency", "1",
                        "--calibration", str(path), "-o", "json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["per_gpu"]["total_bytes"] == observed and out["per_gpu"]["learned_bytes"] == 2 * GIB


async def test_a_restart_keeps_the_measured_booking_and_reads_the_learned_records_back(km: Any,
                                                                                      cluster: Cluster) -> None:
    op = Operator(km)
    await op.start()
    try:
        await cluster.create(node("gpu-a", gpus=1, annotations=inventory(1)))
        await cluster.create(vd("first", QWEN7, **FIXED))
        await cluster.phase("first", "Admitted")
        predicted = mem(cluster, "first")["totalBytes"]
        uid = await pod(cluster, "first", ready=True)
        await agent(cluster, "gpu-a", 1, {0: [(uid, predicted + 2 * GIB)]})
        await cluster.until(lambda: mem(cluster, "first")["totalBytes"] == predicted + 2 * GIB + MARGIN)
        await cluster.until(lambda: any(o["metadata"]["name"] == defaults.CALIBRATION_CONFIGMAP
                                        for o in cluster.objects("v1/configmaps")), what="the ConfigMap")
        learned = list(cluster.store.cache.learned)
    finally:
        await op.stop()
    await cluster.reconnect()
    await op.start()
    try:
        st = cluster.store
        assert st.cache.learned == learned  # read back from the operator's own ConfigMap at start-up
        [b] = st.books.ledger.bookings_of("default/first")
        assert (b.footprint.total, b.footprint.observed_excess) == (predicted + 2 * GIB + MARGIN, 2 * GIB + MARGIN)
        await cluster.create(vd("second", QWEN7, **FIXED))
        await cluster.phase("second", "Admitted")
        assert (mem(cluster, "second")["totalBytes"], mem(cluster, "second")["learnedBytes"]) == (
            predicted + 2 * GIB, 2 * GIB)
    finally:
        await op.stop()
