"""Unit tests of the pure builders: spec + decision -> Deployment, Service, status, conditions."""

from __future__ import annotations

import math
from typing import Any

import pytest

from vllmfit.core import defaults, placement
from vllmfit.core.memory import Footprint
from vllmfit.core.spec import api
from vllmfit.operator.booking import report
from vllmfit.operator.booking.record import Record
from vllmfit.operator.rendering import builders
from vllmfit.sources import catalog

GIB = 1 << 30
H100 = catalog.gpu("NVIDIA-H100-80GB-HBM3")
UUIDS = ["GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000001"]


def obj(name: str = "llama", **spec: Any) -> api.VLLMDeployment:
    return api.VLLMDeployment.model_validate({
        "metadata": {"name": name, "namespace": "team-a", "uid": "u-1"},
        "spec": {"model": "meta-llama/Llama-3.1-8B-Instruct", **spec},
    })


FLAGS = api.Flags(max_model_len=32768, max_num_seqs=8, gpu_memory_utilization=0.4321,
                  kv_cache_memory_bytes=4 * GIB, max_num_batched_tokens=None)


def replica(uuids: list[str | None] | None = None, indices: tuple[int, ...] = (0,), node: str = "gpu-a",
            number: int = 0) -> api.ReplicaPlacement:
    uuids = uuids or [None] * len(indices)
    return api.ReplicaPlacement(replica=number, node=node, gpus=[
        api.GpuRef(index=i, uuid=u, product="NVIDIA-H100-80GB-HBM3") for i, u in zip(indices, uuids)])


def container(d: dict[str, Any]) -> dict[str, Any]:
    [c] = d["spec"]["template"]["spec"]["containers"]
    return c


def env(d: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(d)["env"]}


# --- extraArgs, names --------------------------------------------------------------------------


@pytest.mark.parametrize("arg,field", [
    ("--max-model-len=4096", "spec.maxModelLen"),
    ("--max_model_len", "spec.maxModelLen"),
    ("--max-num-seqs", "spec.maxNumSeqs"),
    ("--gpu-memory-utilization=0.5", "spec.gpuMemoryUtilization"),
    ("--tensor-parallel-size", "spec.tensorParallelSize"),
    ("-tp", "spec.tensorParallelSize"),
    ("-pp=2", "spec.pipelineParallelSize"),
    ("--kv-cache-memory-bytes=1000", "spec.kvCache"),
    ("--dtype", "spec.dtype"),
    ("-q", "spec.quantization"),
    ("--quantization=awq", "spec.quantization"),
    ("--kv-cache-dtype=fp8", "spec.kvCacheDtype"),
    ("--enforce-eager", "spec.enforceEager"),
])
def test_extra_args_that_fight_computed_flags_name_the_spec_field(arg: str, field: str) -> None:
    [problem] = builders.extra_args_problems([arg, "4096"])
    assert arg.split("=")[0] in problem
    assert f"use {field}" in problem


def test_port_in_extra_args_is_refused_without_a_field() -> None:
    [problem] = builders.extra_args_problems(["--port", "9000"])
    assert "remove it" in problem and "8000" in problem


def test_harmless_extra_args_pass() -> None:
    assert builders.extra_args_problems(["--served-model-name", "llama",
                                         "--max-logprobs=5", "--enable-prefix-caching"]) == []


@pytest.mark.parametrize("name,ok", [("llama", True), ("a" * 56, True), ("a" * 57, False), ("Llama", False),
                                     ("llama.v2", False), ("9llama", False), ("llama-", False)])
def test_names_must_be_dns_labels_short_enough_for_replicas(name: str, ok: bool) -> None:
    assert (builders.name_problem(name) is None) == ok


# --- Deployment --------------------------------------------------------------------------------


def test_args_are_the_model_the_computed_flags_the_spec_settings_then_extra_args() -> None:
    o = obj(tensorParallelSize=2, dtype="bfloat16", quantization="fp8", kvCacheDtype="fp8", enforceEager=True,
            maxNumBatchedTokens=4096, extraArgs=["--served-model-name", "llama"])
    d = builders.deployment(o, replica(indices=(0, 1)), FLAGS, "meta-llama/Llama-3.1-8B-Instruct", exclusive=False)
    c = container(d)
    assert c["command"] == ["vllm", "serve"]
    assert c["args"] == [
        "meta-llama/Llama-3.1-8B-Instruct", "--host=0.0.0.0", "--port=8000",
        "--max-model-len=32768", "--max-num-seqs=8", "--gpu-memory-utilization=0.4321",
        "--kv-cache-memory-bytes=4294967296", "--tensor-parallel-size=2", "--pipeline-parallel-size=1", "--dtype=bfloat16", "--kv-cache-dtype=fp8",
        "--quantization=fp8", "--enforce-eager", "--max-num-batched-tokens=4096",
        "--served-model-name", "llama",
    ]


def test_flags_with_batched_tokens_inject_it_once() -> None:
    flags = FLAGS.model_copy(update={"max_num_batched_tokens": 8192})
    d = builders.deployment(obj(maxNumBatchedTokens=8192), replica(), flags, "m", exclusive=False)
    assert [a for a in container(d)["args"] if "batched" in a] == ["--max-num-batched-tokens=8192"]


def test_exclusive_gpus_use_device_plugin_limits_of_tp_times_pp() -> None:
    o = obj(tensorParallelSize=2, pipelineParallelSize=2, resources={"limits": {"memory": "64Gi"}})
    d = builders.deployment(o, replica(indices=(0, 1, 2, 3)), FLAGS, "m", exclusive=True)
    c = container(d)
    assert c["resources"] == {"limits": {"memory": "64Gi", "nvidia.com/gpu": 4}}
    assert "NVIDIA_VISIBLE_DEVICES" not in env(d)
    assert "runtimeClassName" not in d["spec"]["template"]["spec"]
    assert d["metadata"]["annotations"][builders.ANNOTATION_PINNING] == "device-plugin"


def test_shared_gpus_use_visible_devices_by_uuid_and_the_nvidia_runtime_without_limits() -> None:
    o = obj(tensorParallelSize=2, resources={"limits": {"nvidia.com/gpu": 2, "cpu": "8"}})
    d = builders.deployment(o, replica(UUIDS, (0, 1)), FLAGS, "m", exclusive=False)
    assert env(d)["NVIDIA_VISIBLE_DEVICES"] == ",".join(UUIDS)
    assert d["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"
    assert container(d)["resources"] == {"limits": {"cpu": "8"}}  # the user's GPU limit is dropped
    assert d["metadata"]["annotations"][builders.ANNOTATION_PINNING] == "visible-devices"


def test_shared_gpus_fall_back_to_indices_when_a_uuid_is_unknown() -> None:
    d = builders.deployment(obj(tensorParallelSize=2), replica([UUIDS[0], None], (2, 3)), FLAGS, "m",
                            exclusive=False)
    assert env(d)["NVIDIA_VISIBLE_DEVICES"] == "2,3"


def test_deployment_is_pinned_to_its_node_and_recreated_never_rolled() -> None:
    d = builders.deployment(obj(), replica(node="gpu-b", number=3), FLAGS, "m", exclusive=False)
    assert d["metadata"]["name"] == "llama-3"
    assert d["metadata"]["namespace"] == "team-a"
    assert d["spec"]["replicas"] == 1
    assert d["spec"]["strategy"] == {"type": "Recreate"}
    pod = d["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-b"]}]}]
    labels = d["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/managed-by"] == "vllmfit"
    assert labels["vllmfit.dev/deployment"] == "llama"
    assert labels["vllmfit.dev/replica"] == "3"
    assert d["spec"]["selector"]["matchLabels"] == {"vllmfit.dev/deployment": "llama", "vllmfit.dev/replica": "3"}
    assert d["metadata"]["annotations"][builders.ANNOTATION_PLACEMENT] == "gpu-b:0"


def test_probes_port_and_shared_memory() -> None:
    c = container(builders.deployment(obj(), replica(), FLAGS, "m", exclusive=False))
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model loading
    assert c["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    d = builders.deployment(obj(), replica(), FLAGS, "m", exclusive=False)
    assert d["spec"]["template"]["spec"]["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]


def test_hf_token_comes_from_the_secret_reference_and_user_env_is_kept() -> None:
    o = obj(hfTokenSecretRef={"name": "hf", "key": "tok"}, env=[{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
            image="vllm/vllm-openai:v0.21.0")
    d = builders.deployment(o, replica(), FLAGS, "m", exclusive=True)
    e = env(d)
    assert e["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "tok"}}
    assert e["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert container(d)["image"] == "vllm/vllm-openai:v0.21.0"


def test_service_selects_every_replica_on_port_8000() -> None:
    s = builders.service(obj())
    assert s["metadata"]["name"] == "llama"
    assert s["spec"]["selector"] == {"app.kubernetes.io/managed-by": "vllmfit", "vllmfit.dev/deployment": "llama"}
    assert s["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]


# --- Ledger-derived parts ----------------------------------------------------------------------


def h100_node(name: str = "gpu-a", count: int = 2) -> placement.NodeInfo:
    return placement.NodeInfo(name, {}, tuple(placement.GpuSlot(name, i, H100, UUIDS[i]) for i in range(count)))


def fp(total_gib: int) -> Footprint:
    return Footprint(weights=total_gib * GIB - 3 * GIB, kv_cache=2 * GIB, activation=GIB // 2,
                     cuda_context=GIB // 2, non_torch=0, cuda_graphs=0)


def test_exclusive_only_when_it_takes_every_gpu_of_the_node_alone() -> None:
    ledger = placement.Ledger([h100_node()])
    ledger.restore("ns/a", [placement.Booking("ns/a", 0, "gpu-a", 0, fp(10)),
                            placement.Booking("ns/a", 0, "gpu-a", 1, fp(10))])
    assert builders.exclusive(ledger, "ns/a", "gpu-a", [0, 1])
    assert not builders.exclusive(ledger, "ns/a", "gpu-a", [0])  # the device plugin would pick any GPU
    ledger.restore("ns/b", [placement.Booking("ns/b", 0, "gpu-a", 1, fp(10))])
    assert not builders.exclusive(ledger, "ns/a", "gpu-a", [0, 1])
    assert not builders.exclusive(ledger, "ns/a", "gone", [0])


def test_headroom_counts_every_neighbour_on_the_gpu() -> None:
    ledger = placement.Ledger([h100_node()])
    ledger.restore("ns/a", [placement.Booking("ns/a", 0, "gpu-a", 0, fp(20))])
    ledger.restore("ns/b", [placement.Booking("ns/b", 0, "gpu-a", 0, fp(30))])
    budget = math.ceil(0.90 * H100.cuda_total_bytes) + defaults.CUDA_CONTEXT_BYTES  # counted (the default), by hand
    [g] = report.gpu_headroom(ledger, "ns/a")
    assert (g.budget_bytes, g.used_bytes, g.headroom_bytes) == (budget, 50 * GIB, budget - 50 * GIB)
    assert report.headroom_text([g]) == f"{(budget - 50 * GIB) / GIB:.1f} GiB"
    assert builders.neighbours(ledger, {("gpu-a", 0)}) == {"ns/a", "ns/b"}


def test_bookings_survive_a_round_trip_through_the_status() -> None:
    bookings = [placement.Booking("ns/a", 0, "gpu-a", 0, fp(20)), placement.Booking("ns/a", 1, "gpu-a", 1, fp(7))]
    entries = report.memory_entries(bookings)
    status = api.VLLMDeploymentStatus(memory=entries)
    back = placement.bookings_from_status("ns/a", api.VLLMDeploymentStatus.model_validate(
        status.model_dump(by_alias=True, mode="json")))
    assert [(b.replica, b.node, b.index, b.footprint.total) for b in back] == [
        (0, "gpu-a", 0, 20 * GIB), (1, "gpu-a", 1, 7 * GIB)]
    assert [b.footprint.weights for b in back] == [17 * GIB, 4 * GIB]


def test_status_of_an_admitted_deployment() -> None:
    ledger = placement.Ledger([h100_node()])
    ledger.restore("team-a/llama", [placement.Booking("team-a/llama", 0, "gpu-a", 1, fp(20))])
    ledger.restore("team-a/other", [placement.Booking("team-a/other", 0, "gpu-a", 1, fp(10))])
    rec = Record("team-a/llama", {}, ("", "team-a/llama"), generation=3, observed_generation=3, admitted=True,
                 outcome="Admitted", placement=[replica([UUIDS[1]], (1,))], flags=FLAGS, vllm_version="0.33")
    rec.conditions = report.set_condition([], "Ready", "True", "Serving", "1/1 replica ready", "t0", 3)
    st = report.status(rec, ledger)
    budget = math.ceil(0.90 * H100.cuda_total_bytes) + defaults.CUDA_CONTEXT_BYTES  # counted: ceil(0.9 T) + context
    assert st["phase"] == "Running"
    assert (st["node"], st["gpuList"], st["observedGeneration"]) == ("gpu-a", "1", 3)
    assert st["flags"]["maxModelLen"] == 32768 and st["flags"]["gpuMemoryUtilization"] == 0.4321
    assert [m["totalBytes"] for m in st["memory"]] == [20 * GIB]
    assert st["gpus"] == [{"node": "gpu-a", "index": 1, "budgetBytes": budget, "usedBytes": 30 * GIB,
                           "headroomBytes": budget - 30 * GIB}]
    assert st["headroom"] == f"{(budget - 30 * GIB) / GIB:.1f} GiB"


def test_status_of_an_unschedulable_deployment_clears_its_placement() -> None:
    rec = Record("ns/x", {}, ("", "ns/x"), outcome="Unschedulable", reasons=["gpu-a: GPU 0 needs 90 GiB"],
                 suggestions=["maxModelLen: 8192"], placement=[replica()], flags=FLAGS)
    st = report.status(rec, placement.Ledger([h100_node()]))
    assert st["phase"] == "Unschedulable"
    assert st["node"] is None and st["gpuList"] is None and st["flags"] is None and st["headroom"] is None
    assert st["placement"] == [] and st["memory"] == [] and st["gpus"] == []
    assert st["reasons"] == ["gpu-a: GPU 0 needs 90 GiB"] and st["suggestions"] == ["maxModelLen: 8192"]


def test_failed_pods_make_an_admitted_deployment_failed() -> None:
    rec = Record("ns/x", {}, ("", "ns/x"), admitted=True, failed=True, placement=[replica()], flags=FLAGS)
    assert report.phase(rec) == "Failed"


def test_conditions_move_their_transition_time_only_when_status_changes() -> None:
    c = report.set_condition([], "Admitted", "False", "Unschedulable", "no room", "t1", 1)
    c = report.set_condition(c, "Admitted", "False", "Rejected", "bad spec", "t2", 2)
    [a] = c
    assert (a.status, a.reason, a.message, a.last_transition_time, a.observed_generation) == (
        "False", "Rejected", "bad spec", "t1", 2)
    c = report.set_condition(c, "Admitted", "True", "Admitted", "ok", "t3", 3)
    assert c[0].last_transition_time == "t3"
    c = report.set_condition(c, "Ready", "False", "Pending", "", "t4")
    c = report.set_condition(c, "Placed", "True", "Placed", "", "t4")
    assert [x.type for x in c] == ["Admitted", "Placed", "Ready"]
