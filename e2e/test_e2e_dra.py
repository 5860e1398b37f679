"""The DRA placement backend through a real API server, scheduler and DRA driver (kind).

A kind cluster (e2e/kind-dra-config.yaml: DRAConsumableCapacity on, CDI on) runs the
dra-example-driver's GPU profile with consumable memory (8 fake GPUs of 80Gi per node, memory
requests rounded up to 8Gi steps, `allowMultipleAllocations: true`); no real GPU. The chart is
installed with `placement.backend=dra` and the driver's name and DeviceClass. Two colocated
VLLMDeployments are admitted onto one GPU; the scheduler allocates their claims; the claims'
consumed capacity must be what the ledger counts (booked bytes, plus the driver's rounding as
foreign use), and no GPU may hold more than its capacity.

Skipped without kind and Docker (see conftest.py). Knobs: VLLMFIT_E2E_DRA_CLUSTER (cluster
name), VLLMFIT_E2E_DRA_NODE_IMAGE (kind node image, default kindest/node:v1.35.0 by digest),
VLLMFIT_E2E_DRA_DRIVER_REF (dra-example-driver git ref, default v0.4.0), VLLMFIT_E2E_KEEP=1.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import HERE, IMAGE, ROOT, Kube, run, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.dra]

CLUSTER = os.environ.get("VLLMFIT_E2E_DRA_CLUSTER", "vllmfit-dra")
# Pinned by digest (kind v0.31.0's release notes): a re-pushed tag cannot change the API server,
# scheduler and kubelet this test runs against.
NODE_IMAGE = os.environ.get(
    "VLLMFIT_E2E_DRA_NODE_IMAGE",
    "kindest/node:v1.35.0@sha256:452d707d4862f52530247495d180205e029056831160e22870e37e3f6c1ac31f")
DRIVER_REF = os.environ.get("VLLMFIT_E2E_DRA_DRIVER_REF", "v0.4.0")
DRIVER_REPO = "https://github.com/kubernetes-sigs/dra-example-driver"
NAMESPACE, TEST_NAMESPACE = "vllmfit", "e2e-dra"
FAKE_VLLM_IMAGE = "vllm/vllm-openai:v0.33.0"
MODEL = "meta-llama/Llama-3.2-1B-Instruct"  # in the catalog: no Hub access needed
GIB = 1 << 30


def quantity_bytes(q: str) -> int:
    from vllmfit.backends.dra import quantity_bytes as parse

    return parse(q)


@pytest.fixture(scope="module")
def dra_kube(tmp_path_factory: pytest.TempPathFactory, k8s_tools: dict[str, str]) -> Iterator[Kube]:
    kubeconfig = tmp_path_factory.mktemp("kind-dra") / "kubeconfig"
    run(["kind", "create", "cluster", "--name", CLUSTER, "--config", str(HERE / "kind-dra-config.yaml"),
         "--image", NODE_IMAGE, "--wait", "180s", "--kubeconfig", str(kubeconfig)], timeout=600)
    try:
        yield Kube(k8s_tools["kubectl"], kubeconfig)
    finally:
        if os.environ.get("VLLMFIT_E2E_KEEP") != "1":
            run(["kind", "delete", "cluster", "--name", CLUSTER], check=False)


@pytest.fixture(scope="module")
def driver(dra_kube: Kube, k8s_tools: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The dra-example-driver (GPU profile, consumable memory); returns its driver and class names."""
    src = tmp_path_factory.mktemp("dra-example-driver") / "src"
    run(["git", "clone", "--depth", "1", "--branch", DRIVER_REF, DRIVER_REPO, str(src)], timeout=300)
    helm = [k8s_tools["helm"], "--kubeconfig", dra_kube.env["KUBECONFIG"]]
    run([*helm, "upgrade", "--install", "dra-example-driver", str(src / "deployments" / "helm" / "dra-example-driver"),
         "--namespace", "dra-example-driver", "--create-namespace", "--wait", "--timeout", "5m",
         "--set", "deviceProfile=gpu", "--set", "gpuAllowMultipleAllocations=true",
         "--set", "kubeletPlugin.numDevices=2"], timeout=420)
    slices = wait_for(lambda: (dra_kube.get("resourceslices") or {}).get("items"), timeout=180,
                      what="the driver's ResourceSlices")
    name = slices[0]["spec"]["driver"]
    classes = [c["metadata"]["name"] for c in dra_kube.get("deviceclasses")["items"]]
    assert all(d.get("allowMultipleAllocations") for s in slices for d in s["spec"]["devices"]), \
        "the slices lost allowMultipleAllocations: is DRAConsumableCapacity on?"
    return {"driver": name, "class": name if name in classes else classes[0]}


@pytest.fixture(scope="module")
def release(dra_kube: Kube, k8s_tools: dict[str, str], driver: dict[str, str]) -> str:
    for image in (IMAGE, FAKE_VLLM_IMAGE):
        run(["kind", "load", "docker-image", image, "--name", CLUSTER], timeout=600)
    repo, _, tag = IMAGE.rpartition(":")
    helm = [k8s_tools["helm"], "--kubeconfig", dra_kube.env["KUBECONFIG"]]
    run([*helm, "upgrade", "--install", "vllmfit", str(ROOT / "charts" / "vllmfit"), "--namespace", NAMESPACE,
         "--create-namespace", "--wait", "--timeout", "5m",
         "--set", f"image.repository={repo}", "--set", f"image.tag={tag}", "--set", "image.pullPolicy=Never",
         "--set", f"vllmImage={FAKE_VLLM_IMAGE}", "--set", "agent.enabled=false",
         "--set", "placement.backend=dra", "--set", f"placement.dra.driver={driver['driver']}",
         "--set", f"placement.dra.deviceClassName={driver['class']}"], timeout=420)
    dra_kube("create", "namespace", TEST_NAMESPACE, check=False)
    wait_for(lambda: all(h.get("clientConfig", {}).get("caBundle")
                         for h in dra_kube.get("validatingwebhookconfiguration", "vllmfit-validate")["webhooks"]),
             timeout=120, what="the webhook's CA")
    return "vllmfit"


def vllmd(name: str, node: str, max_model_len: int) -> dict[str, Any]:
    return {"apiVersion": "vllmfit.dev/v1alpha1", "kind": "VLLMDeployment",
            "metadata": {"name": name, "namespace": TEST_NAMESPACE},
            "spec": {"model": MODEL, "maxModelLen": max_model_len, "maxNumSeqs": 4,
                     "placement": {"nodeName": node, "gpuIndices": [0]}}}


def test_two_colocated_deployments_claim_what_the_ledger_books(dra_kube: Kube, release: str,
                                                               driver: dict[str, str]) -> None:
    node = f"{CLUSTER}-worker"
    dra_kube.apply([vllmd("first", node, 4096), vllmd("second", node, 8192)])
    statuses = {}
    for name in ("first", "second"):
        statuses[name] = wait_for(
            lambda n=name: ((dra_kube.get("vllmd", n, TEST_NAMESPACE) or {}).get("status") or {}).get("phase")
            in ("Admitted", "Running") and dra_kube.get("vllmd", n, TEST_NAMESPACE)["status"],
            timeout=120, what=f"{name} admitted")
        assert [(m["node"], m["index"]) for m in statuses[name]["memory"]] == [(node, 0)]

    def claims() -> list[dict[str, Any]]:
        items = (dra_kube.get("resourceclaims", namespace=TEST_NAMESPACE) or {}).get("items") or []
        return [c for c in items if (c.get("status") or {}).get("allocation")]

    allocated = wait_for(lambda: len(claims()) == 2 and claims(), timeout=180, what="both claims allocated")
    slices = dra_kube.get("resourceslices")["items"]
    step = next(quantity_bytes(d["capacity"]["memory"]["requestPolicy"]["validRange"]["step"])
                for s in slices for d in s["spec"]["devices"])
    consumed_total = 0
    devices = set()
    for c in allocated:
        owner = c["metadata"]["labels"]["vllmfit.dev/deployment"]
        [result] = c["status"]["allocation"]["devices"]["results"]
        devices.add((result["pool"], result["device"]))
        consumed = quantity_bytes(result["consumedCapacity"]["memory"])
        booked = statuses[owner]["memory"][0]["totalBytes"]
        assert consumed == -(-booked // step) * step  # the request, rounded up by the driver's policy
        # v0.4.0 also publishes `compute` (default: all of it): every capacity is requested, the
        # others at their policy's minimum, or the second claim would not fit (issue 21 item 6)
        device = next(d for s in slices for d in s["spec"]["devices"] if d["name"] == result["device"]
                      and s["spec"]["pool"]["name"] == result["pool"])
        assert set(result["consumedCapacity"]) == set(device["capacity"]), (result, device)
        for cap, spec in device["capacity"].items():
            rng = (spec.get("requestPolicy") or {}).get("validRange") or {}
            if cap != "memory" and rng.get("min"):
                assert quantity_bytes(result["consumedCapacity"][cap]) == quantity_bytes(rng["min"])
        consumed_total += consumed
    assert len(devices) == 1  # colocated on the one GPU vllmfit chose
    # the ledger counts what the scheduler counts: booked bytes plus the rounding as foreign use
    wait_for(lambda: dra_kube.get("vllmd", "second", TEST_NAMESPACE)["status"]["gpus"][0]["usedBytes"]
             == consumed_total, timeout=60, what="the ledger to match the claims")
    capacity = next(quantity_bytes(d["capacity"]["memory"]["value"]) for s in slices for d in s["spec"]["devices"])
    assert consumed_total <= capacity
    out = yaml.safe_dump({"claims": allocated})
    Path(os.environ.get("VLLMFIT_E2E_DRA_DUMP", "/dev/null")).write_text(out)
    print(json.dumps({"consumed_bytes": consumed_total, "capacity_bytes": capacity}))
