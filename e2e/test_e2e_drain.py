"""`kubectl drain` of a node with shared vLLM replicas and their GPU reservation pod (issue 22),
through a real API server and kubectl (kind). Checks what docs/placement-backends.md ("Drain,
cluster autoscaler, Karpenter") says:

1. `kubectl drain --ignore-daemonsets --delete-emptydir-data` refuses the node because the
   reservation pod declares no controller, and evicts nothing (the node stays cordoned);
2. with `--pod-selector='vllmfit.dev/role!=gpu-reservation'` it evicts the vLLM pods and leaves the
   reservation holding the GPU: the replacements stay Pending on the cordoned node (they are
   pinned to it), the deployments stay Admitted there and their memory stays booked;
3. after `kubectl uncordon` the replicas run there again;
4. with `--force` the reservation pod is evicted too, and vllmfit asks for the GPU again: a new
   reservation pod for the node, Pending while the node is cordoned.

Skipped without kind and Docker (see conftest.py). kind has no GPU, so the reservation container
cannot read NVML: the test writes the UUID annotation itself, as `vllmfit reserve` would on a GPU
node, so that the replicas' scheduling gate opens and their pods land on the node.
"""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import CLUSTER, NAMESPACE, TEST_NAMESPACE, Kube, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("release", "debug_on_failure")]

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
NODE = f"{CLUSTER}-worker2"  # one fake H100: two small replicas share its GPU 0
NAMES = ("drain-a", "drain-b")
FAKE_UUID = "GPU-e2e00000-0000-0000-0000-000000000000"
NO_CONTROLLER = "cannot delete Pods that declare no controller (use --force to override)"  # kubectl unmanagedFatal
KEEP_RESERVATIONS = "--pod-selector=vllmfit.dev/role!=gpu-reservation"


def shared(name: str, max_model_len: int = 4096, max_num_seqs: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "vllmfit.dev/v1alpha1",
        "kind": "VLLMDeployment",
        "metadata": {"name": name, "namespace": TEST_NAMESPACE},
        "spec": {"model": MODEL, "maxModelLen": max_model_len, "maxNumSeqs": max_num_seqs,
                 "placement": {"nodeName": NODE, "gpuIndices": [0], "allowReschedule": False}},
    }


def reservations(kube: Kube) -> list[dict[str, Any]]:
    items = kube.get("pods", namespace=NAMESPACE)["items"]
    return [p for p in items if (p["metadata"].get("labels") or {}).get("vllmfit.dev/role") == "gpu-reservation"
            and (p["metadata"].get("annotations") or {}).get("vllmfit.dev/reserve-node") == NODE]


def replica_pods(kube: Kube) -> list[dict[str, Any]]:
    items = kube.get("pods", namespace=TEST_NAMESPACE)["items"]
    return [p for p in items if (p["metadata"].get("labels") or {}).get("vllmfit.dev/deployment") in NAMES
            and not p["metadata"].get("deletionTimestamp")]


def bound(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in pods if p["spec"].get("nodeName") == NODE]


def unschedulable(pod: dict[str, Any]) -> bool:
    return any(c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable"
               for c in (pod.get("status") or {}).get("conditions") or [])


def running_on_the_node(kube: Kube) -> list[dict[str, Any]]:
    """Both replicas' pods bound to NODE (their gate opened), or [] while not yet."""
    pods = bound(replica_pods(kube))
    return pods if len(pods) == len(NAMES) else []


def test_kubectl_drain_of_a_node_with_shared_replicas_and_a_reservation(kube: Kube) -> None:
    try:
        for name in NAMES:
            kube.apply(shared(name))
        for name in NAMES:
            wait_for(lambda n=name: ((kube.get("vllmd", n, TEST_NAMESPACE) or {}).get("status") or {})
                     .get("phase") in ("Admitted", "Running"), timeout=90, what=f"{name} admitted")
        (held,) = wait_for(lambda: bound(reservations(kube)), timeout=120, what=f"the reservation pod on {NODE}")
        rname = held["metadata"]["name"]
        # what `vllmfit reserve` writes on a GPU node (kind has no NVML)
        kube("annotate", "pod", rname, "-n", NAMESPACE, f"vllmfit.dev/gpu-uuid={FAKE_UUID}", "--overwrite")
        before = wait_for(lambda: running_on_the_node(kube), timeout=180, what="both replicas' pods on the node")
        uids = {p["metadata"]["uid"] for p in before}

        # 1. the flags of a plain drain: refused for the reservation pod, nothing evicted
        proc = kube("drain", NODE, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=90s",
                    check=False, timeout=150)
        assert proc.returncode != 0, proc.stdout
        assert NO_CONTROLLER in proc.stderr and f"{NAMESPACE}/{rname}" in proc.stderr, proc.stderr
        assert kube.get("node", NODE)["spec"].get("unschedulable") is True  # drain cordons first
        assert {p["metadata"]["uid"] for p in replica_pods(kube)} >= uids  # no vLLM pod was evicted
        assert [p["metadata"]["name"] for p in bound(reservations(kube))] == [rname]

        # 2. the documented maintenance drain: the vLLM pods go, the reservation keeps the GPU
        kube("drain", NODE, "--ignore-daemonsets", "--delete-emptydir-data", KEEP_RESERVATIONS, "--timeout=120s",
             timeout=180)
        assert not uids & {p["metadata"]["uid"] for p in replica_pods(kube)}  # evicted
        wait_for(lambda: len([p for p in replica_pods(kube) if not p["spec"].get("nodeName") and unschedulable(p)])
                 == len(NAMES), timeout=120, what="the replacement pods Pending on the cordoned node")
        assert [p["metadata"]["name"] for p in bound(reservations(kube))] == [rname]
        for name in NAMES:
            status = kube.get("vllmd", name, TEST_NAMESPACE)["status"]
            assert status["phase"] in ("Admitted", "Running") and status["node"] == NODE, status
        # their memory stays booked: a spec that needs more than the rest of GPU 0 is denied (the
        # drain may have evicted an operator replica: "failed calling webhook" is retried)
        wait_for(lambda: "denied the request" in kube.apply(shared("drain-intruder", 65536, 4), check=False).stderr,
                 timeout=90, what="the webhook to deny a spec that needs the booked room")

        # 3. uncordon: the replicas run on their GPU again
        kube("uncordon", NODE)
        wait_for(lambda: running_on_the_node(kube), timeout=180, what="the replicas back on the node")

        # 4. --force: the reservation is evicted too, and the GPU is asked for again
        kube("drain", NODE, "--ignore-daemonsets", "--delete-emptydir-data", "--force", "--timeout=120s",
             timeout=180)
        assert rname not in {p["metadata"]["name"] for p in reservations(kube) if not p["metadata"].get(
            "deletionTimestamp")}
        wait_for(lambda: [p for p in reservations(kube) if p["metadata"]["name"] != rname
                          and not p["spec"].get("nodeName") and unschedulable(p)],
                 timeout=120, what="a new reservation pod for the node, Pending while it is cordoned")
        for name in NAMES:
            assert kube.get("vllmd", name, TEST_NAMESPACE)["status"]["node"] == NODE
    finally:
        kube("uncordon", NODE, check=False)
        for name in (*NAMES, "drain-intruder"):
            kube("delete", "vllmd", name, "-n", TEST_NAMESPACE, "--ignore-not-found", "--wait=true", "--timeout=90s",
                 check=False)
