"""What runs is what was booked: what a tenant controls in the vllm container (its environment, the
weights' source and cache, request-driven memory, the closed loop's records) cannot grow a server
past its booking. Each test here failed on the code before these rules (the attack was admitted, or
the ConfigMap stayed a live reference in the pod)."""

from __future__ import annotations

from typing import Any

import pytest
from opkit import DEPLOYMENTS, Cluster, Operator, node, vd

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

from vllmfit.core.spec import read, validate  # noqa: E402


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
