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
