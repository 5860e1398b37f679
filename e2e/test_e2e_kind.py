"""vllmfit through a real API server (kind): CRD schema and CEL rules, the admission webhook, the
generated Deployment with the injected flags, status, freeing room on delete, and an operator
restart that loses nothing. Skipped without kind and Docker (see conftest.py).

The fake GPU node `<cluster>-worker` has two H100 80GB (GFD labels + nvidia.com/gpu: 2). Sizes
below come from `vllmfit estimate` for Llama-3.1-8B on an H100 (budget ~74.4 GB):
  65536 x 4 seqs -> ~53 GB per GPU: one fits on a GPU, two do not;
  131072 x 8 seqs -> ~150 GB: never fits.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import yaml

from .conftest import CLUSTER, NAMESPACE, TEST_NAMESPACE, Kube, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("release", "debug_on_failure")]

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
NODE = f"{CLUSTER}-worker"


def vllmd(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "vllmfit.dev/v1alpha1",
        "kind": "VLLMDeployment",
        "metadata": {"name": name, "namespace": TEST_NAMESPACE},
        "spec": {"model": MODEL, **spec},
    }


def pinned(name: str, max_model_len: int, max_num_seqs: int, gpu: int = 0) -> dict[str, Any]:
    return vllmd(
        name,
        maxModelLen=max_model_len,
        maxNumSeqs=max_num_seqs,
        placement={"nodeName": NODE, "gpuIndices": [gpu], "allowReschedule": False},
    )


def admitted(kube: Kube, name: str, timeout: float = 90) -> dict[str, Any]:
    def check():
        obj = kube.get("vllmd", name, TEST_NAMESPACE)
        status = (obj or {}).get("status") or {}
        return obj if status.get("phase") in ("Admitted", "Running") and status.get("flags") else None

    return wait_for(check, timeout=timeout, what=f"vllmd {name} admitted")


def delete(kube: Kube, name: str) -> None:
    kube("delete", "vllmd", name, "-n", TEST_NAMESPACE, "--ignore-not-found", "--wait=true", "--timeout=90s")


def test_printer_columns(kube):
    kube.apply(pinned("columns", 4096, 1))
    try:
        admitted(kube, "columns")
        header, row = kube("get", "vllmd", "columns", "-n", TEST_NAMESPACE).stdout.splitlines()
        assert header.split() == ["NAME", "READY", "MODEL", "STATUS", "AGE"]
        assert row.split()[:3] == ["columns", row.split()[1], MODEL] and row.split()[1].endswith("/1")
        header, row = kube("get", "vllmd", "columns", "-n", TEST_NAMESPACE, "-o", "wide").stdout.splitlines()
        assert header.split() == [
            "NAME", "READY", "MODEL", "STATUS", "AGE", "NODE", "GPUS", "MAX-LEN", "SEQS", "UTIL", "HEADROOM",
        ]
        assert row.split()[5:9] == [NODE, "0", "4096", "1"]
        assert "vllmdeployments" not in kube("get", "all", "-n", TEST_NAMESPACE).stdout  # no `all` category
        kube("scale", "vllmd", "columns", "-n", TEST_NAMESPACE, "--replicas=0")
        scale = kube("get", "--raw", f"/apis/vllmfit.dev/v1alpha1/namespaces/{TEST_NAMESPACE}/vllmdeployments/"
                     "columns/scale").stdout
        assert '"replicas":0' in scale.replace(" ", "")
    finally:
        delete(kube, "columns")


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"model": MODEL, "tensorParallelSize": 0}, "tensorParallelSize"),
        ({"model": MODEL, "gpuMemoryUtilization": 1.5}, "gpuMemoryUtilization"),
        ({"dtype": "auto"}, "model"),
        (
            {"model": MODEL, "placement": {"gpuIndices": [0]}},
            "placement.gpuIndices requires placement.nodeName",
        ),
        (
            {"model": MODEL, "tensorParallelSize": 2, "placement": {"nodeName": NODE, "gpuIndices": [0]}},
            "tensorParallelSize x pipelineParallelSize",
        ),
    ],
)
def test_api_server_rejects_malformed_spec(kube, spec, needle):
    obj = vllmd("malformed")
    obj["spec"] = spec
    proc = kube.apply(obj, check=False)
    assert proc.returncode != 0, "the API server accepted a malformed spec"
    assert needle in proc.stderr, proc.stderr
    assert kube.get("vllmd", "malformed", TEST_NAMESPACE) is None


def test_unknown_field_is_rejected_by_strict_validation(kube):
    obj = vllmd("unknown-field", gpus=2)
    proc = kube("apply", "--validate=strict", "-f", "-", input=yaml.safe_dump(obj), check=False)
    assert proc.returncode != 0 and "gpus" in proc.stderr, proc.stderr


def test_webhook_denies_an_overfit_spec_with_its_reason(kube):
    proc = kube.apply(pinned("overfit", 131072, 8), check=False)
    assert proc.returncode != 0, "an overfit spec was admitted"
    assert 'admission webhook "validate.vllmfit.dev" denied the request' in proc.stderr, proc.stderr
    assert kube.get("vllmd", "overfit", TEST_NAMESPACE) is None


def test_admitted_spec_gets_a_deployment_with_the_injected_flags(kube):
    kube.apply(pinned("big-a", 65536, 4))
    try:
        obj = admitted(kube, "big-a")
        status = obj["status"]
        flags = status["flags"]
        assert flags["maxModelLen"] == 65536 and flags["maxNumSeqs"] == 4
        assert 0 < flags["gpuMemoryUtilization"] <= 1
        assert status["headroom"] and status["node"] == NODE and status["gpuList"] == "0"
        assert status["gpus"] and status["gpus"][0]["headroomBytes"] > 0

        def owned_deployment():
            items = kube.get("deployments", namespace=TEST_NAMESPACE)["items"]
            return [
                d
                for d in items
                if any(
                    o.get("uid") == obj["metadata"]["uid"] for o in d["metadata"].get("ownerReferences", [])
                )
            ]

        (dep,) = wait_for(owned_deployment, timeout=60, what="the generated Deployment")
        container = dep["spec"]["template"]["spec"]["containers"][0]
        cmdline = " ".join(container.get("command", []) + container.get("args", []))
        assert "--max-model-len" in cmdline and "65536" in cmdline
        assert "--max-num-seqs" in cmdline
        assert f"{flags['gpuMemoryUtilization']}" in cmdline
        assert container["image"].endswith("vllm-openai:v0.33.0")  # the chart's vllmImage default
        limits = container["resources"]["limits"]
        assert limits.get("nvidia.com/gpu") in (1, "1")
        columns = kube("get", "vllmd", "big-a", "-n", TEST_NAMESPACE, "--no-headers").stdout.split()
        assert columns[1:4] == [MODEL, status["phase"], NODE]
    finally:
        delete(kube, "big-a")


def test_the_ledger_refuses_a_second_big_one_and_deleting_frees_room(kube):
    kube.apply(pinned("big-a", 65536, 4))
    try:
        admitted(kube, "big-a")
        proc = kube.apply(pinned("big-b", 65536, 4), check=False)
        assert proc.returncode != 0 and "validate.vllmfit.dev" in proc.stderr, proc.stderr

        # the other GPU of the node is free
        kube.apply(pinned("big-c", 65536, 4, gpu=1))
        admitted(kube, "big-c")
        delete(kube, "big-c")

        delete(kube, "big-a")
        wait_for(
            lambda: kube.apply(pinned("big-b", 65536, 4), check=False).returncode == 0,
            timeout=60,
            what="room freed by deleting big-a",
        )
        admitted(kube, "big-b")
    finally:
        for name in ("big-a", "big-b", "big-c"):
            delete(kube, name)


def test_operator_restart_loses_nothing(kube):
    kube.apply(pinned("keeper", 65536, 4))
    try:
        before = admitted(kube, "keeper")["status"]
        kube("delete", "pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=operator", "--wait=true")
        kube(
            "rollout", "status", "-n", NAMESPACE, "deployment/vllmfit-operator", "--timeout=180s", timeout=200
        )
        time.sleep(5)  # let the new replicas list the existing objects
        # the ledger was rebuilt from the cluster: the GPU is still taken ...
        wait_for(
            lambda: "validate.vllmfit.dev" in kube.apply(pinned("intruder", 65536, 4), check=False).stderr,
            timeout=90,
            what="the restarted webhook to refuse an overfit",
        )
        # ... and the admitted deployment kept its placement and flags
        after = kube.get("vllmd", "keeper", TEST_NAMESPACE)["status"]
        for key in ("flags", "node", "gpuList", "placement", "memory"):
            assert after.get(key) == before.get(key), key
    finally:
        for name in ("keeper", "intruder"):
            delete(kube, name)


def test_agent_runs_on_the_gpu_nodes(kube):
    ds = kube.get("daemonset", "vllmfit-agent", NAMESPACE)
    assert ds["status"]["desiredNumberScheduled"] == 2  # the two labelled workers
    wait_for(
        lambda: kube.get("daemonset", "vllmfit-agent", NAMESPACE)["status"].get("numberReady") == 2,
        timeout=120,
        what="agent pods ready",
    )
