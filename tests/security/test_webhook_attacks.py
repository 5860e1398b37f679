"""Issue 21: the tenant attacks sent to the real admission webhook over HTTPS (a Kopf operator with
KMock as its API server, the client trusting only the CA it injected): every GPU escape, poison
template, load/code flag and catalog modelConfig is denied 422 with one line naming the field; a
good spec with a harmless sidecar is allowed. Run on the old code: every escape but the
nvidia.com/gpu sidecar was allowed, and `affinity: "x"` was allowed."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from webhook_harness import FakeStore, Harness, admission_review, gfd_node, vllmd

from vllmfit.operator.admission import webhook

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SIDE = {"name": "proxy", "image": "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04"}

ATTACKS: list[tuple[str, dict[str, Any], str]] = [
    ("sidecar sees all GPUs", {"podTemplate": {"spec": {"containers": [
        {**SIDE, "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]}}},
     "podTemplate.spec.containers[proxy].env[NVIDIA_VISIBLE_DEVICES]"),
    ("privileged vllm", {"podTemplate": {"spec": {"containers": [
        {"name": "vllm", "securityContext": {"privileged": True}}]}}},
     "podTemplate.spec.containers[vllm].securityContext.privileged"),
    ("shared GPU on a sidecar", {"podTemplate": {"spec": {"containers": [
        {**SIDE, "resources": {"limits": {"nvidia.com/gpu.shared": 1}}}]}}},
     "podTemplate.spec.containers[proxy].resources.limits[nvidia.com/gpu.shared]"),
    ("hostIPC", {"podTemplate": {"spec": {"hostIPC": True}}}, "podTemplate.spec.hostIPC"),
    ("/dev mount", {"podTemplate": {"spec": {"volumes": [{"name": "dev", "hostPath": {"path": "/dev/"}}]}}},
     "podTemplate.spec.volumes[dev].hostPath.path"),
    ("CDI annotation", {"podTemplate": {"metadata": {"annotations": {"cdi.k8s.io/x": "nvidia.com/gpu=all"}}}},
     "podTemplate.metadata.annotations[cdi.k8s.io/x]"),
    ("poison affinity", {"podTemplate": {"spec": {"affinity": "x"}}}, "podTemplate.spec.affinity must be an object"),
    ("dummy weights", {"extraArgs": ["--load-format", "dummy"]}, "extraArgs --load-format 'dummy'"),
    ("worker class", {"extraArgs": ["--worker-extension-cls=evil.Ext"]}, "extraArgs --worker-extension-cls"),
    ("revision", {"extraArgs": ["--revision=refs/pr/1"]}, "extraArgs --revision"),
    ("catalog modelConfig", {"modelConfig": {"model_type": "llama"}}, "spec.modelConfig: " + MODEL),
    # issue 30: the allow-lists, over HTTPS
    ("hostPath /run", {"podTemplate": {"spec": {"volumes": [{"name": "run", "hostPath": {"path": "/run"}}]}}},
     "podTemplate.spec.volumes[run].hostPath.path '/run'"),
    ("vllm postStart", {"podTemplate": {"spec": {"containers": [
        {"name": "vllm", "lifecycle": {"postStart": {"exec": {"command": ["python3", "-c", "1"]}}}}]}}},
     "podTemplate.spec.containers[vllm].lifecycle"),
    ("PYTHONPATH", {"env": [{"name": "PYTHONPATH", "value": "/cfg"}]}, "spec.env PYTHONPATH"),
    ("SYS_ADMIN", {"podTemplate": {"spec": {"containers": [
        {"name": "vllm", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]}}},
     "podTemplate.spec.containers[vllm].securityContext.capabilities.add[SYS_ADMIN]"),
    ("mm processor kwargs", {"extraArgs": ["--mm-processor-kwargs={}"]}, "extraArgs --mm-processor-kwargs"),
    ("envFrom Secret", {"podTemplate": {"spec": {"containers": [
        {"name": "vllm", "envFrom": [{"secretRef": {"name": "s"}}]}]}}},
     "podTemplate.spec.containers[vllm].envFrom[secretRef s]"),
]


@pytest.fixture(scope="module")
def hook() -> Any:
    with Harness(FakeStore([gfd_node("gpu-node-a", 1)])) as h, \
            httpx.Client(base_url=h.url, verify=h.ssl_context(), timeout=10) as c:
        h.client = c
        yield h


def validate(h: Any, spec: dict[str, Any]) -> dict[str, Any]:
    r = h.client.post(f"/{webhook.VALIDATE_ID}", json=admission_review(vllmd("t", "tenant-a", model=MODEL, **spec)))
    assert r.status_code == 200, r.text
    return r.json()["response"]


@pytest.mark.parametrize("name,spec,field", ATTACKS, ids=[a[0] for a in ATTACKS])
def test_each_attack_is_denied_naming_the_field(hook: Any, name: str, spec: dict[str, Any], field: str) -> None:
    resp = validate(hook, {"maxModelLen": 4096, **spec})
    assert resp["allowed"] is False and resp["status"]["code"] == 422, resp
    assert field in resp["status"]["message"] and "\n" not in resp["status"]["message"]


def test_a_harmless_sidecar_is_allowed(hook: Any) -> None:
    spec = {"maxModelLen": 4096, "podTemplate": {"spec": {"containers": [
        {**SIDE, "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": ""}], "resources": {"limits": {"cpu": "1"}}}],
        "volumes": [{"name": "cache", "persistentVolumeClaim": {"claimName": "hf-cache"}}]}}}
    resp = validate(hook, spec)
    assert resp["allowed"] is True, resp
