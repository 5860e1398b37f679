"""What `kubectl drain`, the cluster autoscaler's scale-down and Karpenter do with the two kinds
of pod vllmfit makes (issue 22, "Reservation lifecycle"): a GPU reservation pod
(`backends.reservation.reservation_pod`) and a vLLM replica's pod (the template of
`operator.builders.deployment`).

Each upstream rule is named with the file that holds it, and the test asserts only what that rule
reads from the pod (a controller ownerReference, an emptyDir and its medium, an annotation and its
exact value, the priority class, the node affinity); the outcome it then gives is stated next to
it. Nothing of kubectl or the autoscaler is re-implemented here. Sources read:

  kubectl     kubernetes/kubectl pkg/drain/filters.go (makeFilters: skipDeleted, daemonSet,
              mirrorPod, localStorage, unreplicated) and pkg/drain/drain.go (GetPodsForDeletion:
              one filter error and nothing is evicted), pkg/cmd/drain/drain.go (the flags)
  autoscaler  kubernetes/autoscaler cluster-autoscaler/simulator/drainability/rules/rules.go
              (Default: mirror, longterminating, [replicacount], daemonset, safetoevict, terminal,
              replicated, [system], notsafetoevict, [localstorage], pdb), the rules' rule.go files,
              cluster-autoscaler/utils/drain/drain.go (ControllerRef, HasBlockingLocalStorage,
              isLocalVolume, HasSafeToEvictAnnotation, HasNotSafeToEvictAnnotation),
              cluster-autoscaler/FAQ.md ("What types of pods can prevent CA from removing a
              node?", "How does Cluster Autoscaler work with Pod Priority and Preemption?", flag
              defaults: --skip-nodes-with-local-storage=true,
              --skip-nodes-with-custom-controller-pods=true, --expendable-pods-priority-cutoff=-10)
  Karpenter   kubernetes-sigs/karpenter pkg/utils/pod/scheduling.go (HasDoNotDisrupt: the pod
              annotation karpenter.sh/do-not-disrupt == "true"); karpenter.sh reference,
              "Well-Known Annotations" (blocks consolidation of the pod's node, and drift unless
              the NodeClaim sets a terminationGracePeriod; not expiration, repair, or forceful
              termination)
"""

from __future__ import annotations

from typing import Any

from vllmfit.backends import reservation as rsv
from vllmfit.core.spec import api
from vllmfit.operator.rendering import builders

NODE = "gpu-a"
UUID = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
SAFE_TO_EVICT = "cluster-autoscaler.kubernetes.io/safe-to-evict"  # utils/drain/drain.go PodSafeToEvictKey
SAFE_TO_EVICT_LOCAL_VOLUMES = "cluster-autoscaler.kubernetes.io/safe-to-evict-local-volumes"
DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"
MIRROR = "kubernetes.io/config.mirror"  # corev1.MirrorPodAnnotationKey


def reservation() -> dict[str, Any]:
    """As the chart runs the operator: its own priority class for reservation pods."""
    cfg = rsv.Config(namespace="vllmfit", priority_class="vllmfit-reservation")
    return rsv.reservation_pod(cfg, NODE, 0, "vllmfit-gpu-x-0")


def vllm_deployment() -> dict[str, Any]:
    """A replica sharing GPU 0 of NODE (no GPU limit, pinned by UUID, behind the gate)."""
    obj = api.VLLMDeployment.model_validate({
        "metadata": {"name": "llama", "namespace": "team-a", "uid": "u-1"},
        "spec": {"model": "meta-llama/Llama-3.1-8B-Instruct"}})
    placed = api.ReplicaPlacement(replica=0, node=NODE, gpus=[api.GpuRef(index=0, uuid=UUID)])
    flags = api.Flags(max_model_len=8192, max_num_seqs=8, gpu_memory_utilization=0.4,
                      kv_cache_memory_bytes=4 << 30, max_num_batched_tokens=None)
    return builders.deployment(obj, placed, flags, "meta-llama/Llama-3.1-8B-Instruct", exclusive=False,
                               pins=[UUID], gated=True)


def controller(meta: dict[str, Any]) -> dict[str, Any] | None:
    """metav1.GetControllerOf: the ownerReference with controller: true."""
    return next((r for r in meta.get("ownerReferences") or [] if r.get("controller")), None)


def empty_dirs(spec: dict[str, Any]) -> dict[str, str]:
    """Volume name -> emptyDir medium ("" for the node's disk)."""
    return {v["name"]: (v["emptyDir"] or {}).get("medium", "") for v in spec.get("volumes") or [] if "emptyDir" in v}


def pinned_to(spec: dict[str, Any]) -> list[str]:
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    return [v for t in terms for f in t.get("matchFields") or [] if f["key"] == "metadata.name" for v in f["values"]]


def test_kubectl_drain_refuses_a_reservation_pod_without_force_and_evicts_vllm_pods() -> None:
    r, d = reservation(), vllm_deployment()
    rmeta, rspec = r["metadata"], r["spec"]
    vmeta, vspec = d["spec"]["template"]["metadata"], d["spec"]["template"]["spec"]
    # daemonSetFilter: only a pod whose controller is an apps/v1 DaemonSet is held back. Neither is.
    assert controller(rmeta) is None
    assert d["apiVersion"] == "apps/v1" and d["kind"] == "Deployment"  # its pods' controller: a ReplicaSet
    # mirrorPodFilter: a pod with the mirror annotation is skipped. Neither has it.
    assert MIRROR not in rmeta["annotations"] and MIRROR not in vmeta["annotations"]
    # localStorageFilter (hasLocalStorage: ANY emptyDir, whatever its medium): without
    # --delete-emptydir-data both are an error ("Pods with local storage"); with it, deleted.
    assert empty_dirs(rspec) == {"run": ""}  # the reservation's report file, on the node's disk
    assert empty_dirs(vspec) == {"dshm": "Memory"}  # /dev/shm for NCCL: still an emptyDir for kubectl
    # unreplicatedFilter: a running pod with no controller is an error unless --force ("Pods that
    # declare no controller (use --force to override)"). The reservation pod has none: with
    # `--ignore-daemonsets --delete-emptydir-data` GetPodsForDeletion returns that error and
    # kubectl evicts nothing; the vLLM pod's ReplicaSet controller passes.
    assert "ownerReferences" not in rmeta
    assert "ownerReferences" not in vmeta  # the ReplicaSet controller sets the pod's controllerRef
    # so the documented drains leave the reservations alone (--pod-selector, a label selector on
    # the pods of the node: `!=` also selects pods without the label), or delete them (--force)
    assert rmeta["labels"][rsv.ROLE_LABEL] == rsv.ROLE == "gpu-reservation"
    assert rsv.ROLE_LABEL == "vllmfit.dev/role" and rsv.ROLE_LABEL not in vmeta["labels"]
    # What the evicted vLLM pod's replacement does: it is pinned to this node by required node
    # affinity, so on the cordoned node it stays Pending (NodeUnschedulable) until uncordon;
    # its tolerations are vllmfit's nvidia.com/gpu one and the spec's, not the cordon's.
    assert pinned_to(vspec) == [NODE] == pinned_to(rspec)
    assert all(t.get("key") != "node.kubernetes.io/unschedulable" for t in vspec["tolerations"] + rspec["tolerations"])


def test_the_cluster_autoscaler_never_scales_down_a_node_under_a_reservation_or_a_replica() -> None:
    r, d = reservation(), vllm_deployment()
    rmeta, rspec = r["metadata"], r["spec"]
    vmeta, vspec = d["spec"]["template"]["metadata"], d["spec"]["template"]["spec"]
    # rules/safetoevict (interrupting, checked before every blocking rule): safe-to-evict == "true"
    # makes a pod drainable whatever follows. Neither pod says "true".
    assert rmeta["annotations"].get(SAFE_TO_EVICT) != "true"
    assert vmeta["annotations"].get(SAFE_TO_EVICT) != "true"
    # rules/replicated: a pod without a controller is Blocked (NotReplicated), whatever the flags;
    # with --skip-nodes-with-custom-controller-pods (default true) only ReplicationController, Job,
    # ReplicaSet and StatefulSet controllers count. Reservation: no controller -> Blocked.
    # vLLM pod: a ReplicaSet -> passes.
    assert controller(rmeta) is None
    assert d["kind"] == "Deployment"
    # rules/notsafetoevict: safe-to-evict == "false" is Blocked (NotSafeToEvictAnnotation), with
    # no flag to turn it off and whatever controller the pod gets: vllmfit says so explicitly on
    # every reservation pod, so a node whose GPUs are booked is never scaled down under its vLLM
    # servers even if reservations get an owner one day.
    assert rmeta["annotations"][SAFE_TO_EVICT] == "false"
    assert SAFE_TO_EVICT not in vmeta["annotations"]
    # rules/localstorage (only with --skip-nodes-with-local-storage, default true):
    # HasBlockingLocalStorage is a hostPath, or an emptyDir whose medium is not Memory, not named
    # in safe-to-evict-local-volumes. Reservation: "run" on disk -> Blocked as well. vLLM pod:
    # only a Memory emptyDir -> no local storage for the autoscaler.
    assert empty_dirs(rspec) == {"run": ""} and SAFE_TO_EVICT_LOCAL_VOLUMES not in rmeta["annotations"]
    assert set(empty_dirs(vspec).values()) == {"Memory"}
    assert not any("hostPath" in v for v in rspec["volumes"] + vspec["volumes"])
    # Expendable pods (priority below --expendable-pods-priority-cutoff, default -10) never block a
    # scale-down. The reservation's priority class is the configured one (the chart's own, value
    # 1000000); vllmfit sets none on the vLLM pod (priority 0, or the spec's podTemplate class).
    assert rspec["priorityClassName"] == "vllmfit-reservation"
    assert "priorityClassName" not in vspec
    # rules/pdb: vllmfit makes no PodDisruptionBudget (nothing to look at on the pods).
    # The removal simulation (FAQ: "Pods that cannot be moved elsewhere due to scheduling
    # constraints"): both are pinned to their node by required node affinity, so no other node
    # can take them and the vLLM pod alone (a node held whole by device-plugin limits, no
    # reservation) also keeps its node.
    assert pinned_to(vspec) == [NODE] == pinned_to(rspec)


def test_karpenter_does_not_consolidate_a_node_under_a_reservation() -> None:
    r, d = reservation(), vllm_deployment()
    # HasDoNotDisrupt: the annotation's value must be exactly "true".
    assert r["metadata"]["annotations"][DO_NOT_DISRUPT] == "true"
    # The vLLM pod carries it only when the spec's podTemplate metadata does (not by default).
    assert DO_NOT_DISRUPT not in d["spec"]["template"]["metadata"]["annotations"]
