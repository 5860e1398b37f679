"""What runs is what was booked: what a tenant controls in the vllm container (its environment, the
weights' source and cache, request-driven memory, the closed loop's records) cannot grow a server
past its booking. Each test here failed on the code before these rules (the attack was admitted, or
the ConfigMap stayed a live reference in the pod)."""

from __future__ import annotations

import json
import uuid as uuidlib
from datetime import UTC, datetime
from typing import Any

import pytest
from opkit import DEPLOYMENTS, Cluster, Operator, node, vd

from vllmfit.core import defaults
from vllmfit.core.defaults import GIB
from vllmfit.core.spec import read, validate

pytestmark = pytest.mark.looptime

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def vllm_container(dep: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")


async def test_an_envfrom_configmap_edited_after_admission_cannot_reach_the_container(
        cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.core.create_namespaced_config_map("default", {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "log-env"},
        "data": {"VLLM_LOGGING_LEVEL": "DEBUG", "HF_HUB_OFFLINE": "1"}})
    await cluster.create(vd("logs", MODEL, maxModelLen=4096, env=[{"name": "HF_HUB_OFFLINE", "value": "0"}],
                            podTemplate={"spec": {"containers": [
                                {"name": "vllm", "envFrom": [{"configMapRef": {"name": "log-env"}}]}]}}))
    await cluster.phase("logs", "Admitted")
    dep = await cluster.until(lambda: cluster.get(DEPLOYMENTS, "logs-0"), what="logs-0 written")
    c = vllm_container(dep)
    assert "envFrom" not in c  # no live reference to the ConfigMap
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["VLLM_LOGGING_LEVEL"] == "DEBUG"  # copied when it was checked
    assert env["HF_HUB_OFFLINE"] == "0"  # spec.env wins over envFrom, as in Kubernetes
    # the tenant edits the ConfigMap: code in the GPU container at the next start, if it reached it
    await cluster.core.patch_namespaced_config_map("log-env", "default", {"data": {"PYTHONPATH": "/extra"}})
    before = cluster.get(DEPLOYMENTS, "logs-0")
    await cluster.patch_spec("logs", {"extraArgs": ["--served-model-name", "x"]})
    st = await cluster.until(lambda: any("PYTHONPATH" in c.get("message", "") for c in
                                         cluster.status("logs").get("conditions", [])) and cluster.status("logs"),
                             what="the edited ConfigMap refused at the next check")
    assert any("envFrom[configMapRef log-env] PYTHONPATH" in c.get("message", "") for c in st["conditions"])
    after = cluster.get(DEPLOYMENTS, "logs-0")
    assert "PYTHONPATH" not in str(after) and vllm_container(after)["env"] == vllm_container(before)["env"]


# --- What a tenant writes: the weights' source and request-driven memory, refused by the one validator



def verdict(spec: dict[str, Any], policy: validate.Policy = validate.DEFAULT_POLICY,
            sources: validate.Sources | None = None) -> str | None:
    body = {"metadata": {"name": "t", "namespace": "tenant-a"}, "spec": {"model": MODEL, "maxModelLen": 4096, **spec}}
    try:
        read.checked(read.deployment(body), catalog_model=True, policy=policy, sources=sources)
    except read.SpecError as e:
        return str(e)
    return None


MIRROR = "https://hf-mirror.internal.example"


def test_a_tenants_hf_endpoint_is_refused_and_only_an_admins_mirror_allowed() -> None:
    own = {"env": [{"name": "HF_ENDPOINT", "value": "https://tenant.example"}]}
    assert "spec.env HF_ENDPOINT downloads the model from another endpoint" in (verdict(own) or "")
    assert verdict(own, validate.Policy(hf_endpoints=(MIRROR,))) is not None
    mirror = {"env": [{"name": "HF_ENDPOINT", "value": MIRROR + "/"}]}
    assert verdict(mirror) is not None
    assert verdict(mirror, validate.Policy(hf_endpoints=(MIRROR,))) is None
    # through a Secret the value is unknown, through an envFrom ConfigMap it is read and checked
    secret = {"env": [{"name": "HF_ENDPOINT", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}
    assert verdict(secret, validate.Policy(hf_endpoints=(MIRROR,))) is not None
    env_from = {"podTemplate": {"spec": {"containers": [{"name": "vllm", "envFrom": [{"configMapRef": {"name": "m"}}]}]}}}
    policy = validate.Policy(hf_endpoints=(MIRROR,))
    assert "envFrom[configMapRef m] HF_ENDPOINT" in (verdict(env_from, policy, {("ConfigMap", "m"): {
        "HF_ENDPOINT": "https://tenant.example"}}) or "")
    assert verdict(env_from, policy, {("ConfigMap", "m"): {"HF_ENDPOINT": MIRROR}}) is None


@pytest.mark.parametrize("args", [["--max-logprobs", "-1"], ["--max-logprobs=-1"], ["--max_logprobs", "21"],
                                  ["--max-logp=100000"], ["--max-logprobs", "x"]])
def test_unbounded_logprobs_are_refused_unless_the_admin_raises_the_bound(args: list[str]) -> None:
    why = verdict({"extraArgs": args})
    assert why is not None and "top logprobs per token" in why, why
    if args[-1].lstrip("-=").split("=")[-1] in ("21",):
        assert verdict({"extraArgs": args}, validate.Policy(max_logprobs=64)) is None
    if "-1" in args[-1]:
        assert verdict({"extraArgs": args}, validate.Policy(max_logprobs=1024)) is not None


def test_logprobs_within_vllms_default_stay_allowed() -> None:
    assert verdict({"extraArgs": ["--max-logprobs", "20"]}) is None
    assert verdict({"extraArgs": ["--max-logprobs=0"]}) is None


@pytest.mark.parametrize("value", ["fastsafetensors", "dummy", "tensorizer", "gguf", "bitsandbytes"])
def test_load_formats_with_a_loading_peak_or_other_weights_are_refused(value: str) -> None:
    why = verdict({"extraArgs": ["--load-format", value]})
    assert why is not None and "--load-format" in why, why


@pytest.mark.parametrize("value", ["auto", "safetensors", "pt", "npcache", "runai_streamer"])
def test_load_formats_that_load_per_tensor_stay_allowed(value: str) -> None:
    assert verdict({"extraArgs": ["--load-format", value]}) is None


# --- The closed loop cannot be poisoned: a tenant that drives its own server far over its prediction
# after its start teaches nothing, and what a start teaches stays in its namespace. On the old code
# every report of a started replica taught, the largest over-run was kept for every namespace, and
# tenant B's deployment below was Unschedulable on an empty GPU ("needs at least 78.6 GiB").



QWEN7 = "Qwen/Qwen2.5-7B-Instruct"
CAPACITY = 81559 * 1024 * 1024  # what NVML reports as an H100 80GB's total
SPEC = {"maxModelLen": 8192, "kvCache": {"concurrency": 1}}


def inventory(procs: list[tuple[str, int]]) -> dict[str, str]:
    ps = [{"pid": 100 + k, "used_bytes": n, "pod_uid": uid} for k, (uid, n) in enumerate(procs)]
    gpu = {"index": 0, "uuid": "GPU-00000000-0000-0000-0000-000000000000", "product": "NVIDIA-H100-80GB-HBM3",
           "total_bytes": CAPACITY, "used_bytes": sum(p["used_bytes"] for p in ps), "processes": ps}
    at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {defaults.INVENTORY_ANNOTATION: json.dumps({"sampled_at": at, "nvml": True, "gpus": [gpu]})}


async def ready_pod(cluster: Cluster, name: str, ns: str) -> str:
    uid = str(uuidlib.uuid4())
    labels = {defaults.DEPLOYMENT_LABEL: name, "vllmfit.dev/replica": "0", defaults.MANAGED_BY_LABEL: defaults.MANAGED_BY}
    await cluster.create({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": f"{name}-0-{uid[:5]}", "namespace": ns, "uid": uid, "resourceVersion": "1", "labels": labels},
        "status": {"phase": "Running", "containerStatuses": [{
            "name": "vllm", "image": defaults.DEFAULT_IMAGE, "imageID": "", "ready": True, "restartCount": 0,
            "state": {"running": {}}}]}})
    await cluster.until(lambda: uid in cluster.store.cache.managed_pods(), what=f"the operator to see {name}'s pod")
    return uid


async def phase(cluster: Cluster, name: str, ns: str, *phases: str) -> dict[str, Any]:
    await cluster.until(lambda: cluster.status(name, ns).get("phase") in phases, what=f"{ns}/{name} to reach {phases}")
    await cluster.store.writer.flush()
    return cluster.status(name, ns)


def total(cluster: Cluster, name: str, ns: str) -> tuple[int, int]:
    [m] = cluster.status(name, ns)["memory"]
    return m["totalBytes"], m.get("learnedBytes") or 0


async def started_a(cluster: Cluster) -> tuple[int, str]:
    """Tenant A's deployment `a` admitted on gpu-a and its replica's pod Ready: (its prediction, pod UID)."""
    await cluster.create(node("gpu-a", gpus=1, annotations=inventory([])))
    await cluster.create(vd("a", QWEN7, ns="tenant-a", **SPEC))
    await phase(cluster, "a", "tenant-a", "Admitted")
    predicted, _ = total(cluster, "a", "tenant-a")
    uid = await ready_pod(cluster, "a", "tenant-a")
    return predicted, uid


async def test_a_tenant_that_over_runs_after_its_start_cannot_make_another_namespace_unschedulable(
        cluster: Cluster, operator: Operator) -> None:
    predicted, uid = await started_a(cluster)
    # its start: 1 GiB over the prediction, within the bound -> taught, for tenant-a only
    await cluster.patch_node("gpu-a", {"metadata": {"annotations": inventory([(uid, predicted + GIB)])}})
    await cluster.until(lambda: cluster.store.cache.learned, what="a learned record")
    # then the tenant drives its server to the GPU's capacity with requests: that teaches nothing
    await cluster.patch_node("gpu-a", {"metadata": {"annotations": inventory([(uid, CAPACITY - GIB)])}})
    await cluster.until(lambda: cluster.store.books.ledger.bookings_of("tenant-a/a")[0].footprint.total
                        > predicted + 50 * GIB, what="a's booking grows")
    # tenant B, the same configuration in another namespace, on an empty GPU: booked at its prediction
    await cluster.create(node("gpu-b", gpus=1, annotations=inventory([])))
    await cluster.create(vd("b", QWEN7, ns="tenant-b", placement={"nodeName": "gpu-b"}, **SPEC))
    st = await phase(cluster, "b", "tenant-b", "Admitted")
    assert st["node"] == "gpu-b" and total(cluster, "b", "tenant-b") == (predicted, 0)
    # what was taught: A's start, for A's namespace, who and when
    [rec] = cluster.store.cache.learned
    assert (rec.namespace, rec.observed_bytes - rec.predicted_bytes) == ("tenant-a", GIB)
    assert "tenant-a/a replica 0 on gpu-a GPU 0" in rec.source and rec.learned_at > 0
    # tenant A's next deployment of it books what A's start taught
    await cluster.create(node("gpu-c", gpus=1, annotations=inventory([])))
    await cluster.create(vd("a2", QWEN7, ns="tenant-a", placement={"nodeName": "gpu-c"}, **SPEC))
    await phase(cluster, "a2", "tenant-a", "Admitted")
    assert total(cluster, "a2", "tenant-a") == (predicted + GIB, GIB)


async def test_a_start_far_over_its_prediction_flags_its_deployment_and_teaches_nothing(
        cluster: Cluster, operator: Operator) -> None:
    predicted, uid = await started_a(cluster)
    await cluster.patch_node("gpu-a", {"metadata": {"annotations": inventory([(uid, predicted + 30 * GIB)])}})
    st = await cluster.until(lambda: next((c for c in cluster.status("a", "tenant-a").get("conditions") or []
                                           if c["type"] == "Overrun"), None), what="the Overrun condition")
    assert st["status"] == "True" and "30.0 GiB over the predicted" in st["message"]
    assert cluster.store.cache.learned == []
    await cluster.until(lambda: any(e.get("reason") == "OverrunNotLearned" for e in cluster.events("a")),
                        what="the OverrunNotLearned Event")
