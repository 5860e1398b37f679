"""The VLLMDeployment status: what the operator reports (phase, conditions, placement, flags,
per-GPU memory and headroom, what the agent observed). Re-exported by `vllmfit.core.spec.api`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from vllmfit.core import defaults, limits
from vllmfit.core.spec.base import ApiModel as _Model
from vllmfit.core.spec.base import Phase


class Condition(_Model):
    """A Kubernetes-convention condition."""

    type: str = Field(description="Admitted, Placed, Ready or MemoryDrift.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", description="CamelCase reason.")
    message: str = Field(default="", description="Human-readable explanation.")
    last_transition_time: str | None = Field(default=None, description="RFC 3339 time of the last status change.")
    observed_generation: int | None = Field(default=None, description="Spec generation this condition is about.")


class GpuRef(_Model):
    """One GPU a replica runs on."""

    index: int = Field(description="NVML index on the node.")
    uuid: str | None = Field(default=None, description="GPU UUID (from the node agent), if known.")
    product: str = Field(default="", description="Product name as GPU Feature Discovery labels it.")


class PodPlacement(_Model):
    """One pod of a replica across nodes after its leader: a LeaderWorkerSet worker."""

    node: str = Field(description="Node name.")
    gpus: list[GpuRef] = Field(description="The worker's GPUs on that node, in rank order.")


class ReplicaPlacement(_Model):
    """Where one replica (one TP x PP group) runs: one node, or its leader's node and its workers'."""

    replica: int = Field(description="Replica number, from 0.")
    node: str = Field(description="Node name (the leader's, for a replica across nodes).")
    gpus: list[GpuRef] = Field(description="The GPUs of the group (the leader's), in rank order.")
    workers: list[PodPlacement] = Field(
        default_factory=list,
        description="A replica across nodes (a LeaderWorkerSet): the pods after the leader, in rank order.",
    )

    def pods(self) -> list[ReplicaPlacement]:
        """Every pod of the replica as a one-node placement, the leader first."""
        return [ReplicaPlacement(replica=self.replica, node=self.node, gpus=self.gpus)] + [
            ReplicaPlacement(replica=self.replica, node=w.node, gpus=w.gpus) for w in self.workers
        ]


class Flags(_Model):
    """The vLLM flags vllmfit computed and injects: the one flag type. The memory core's sizing
    makes them (`vllmfit.core.memory.Flags` is this class), decisions and the ledger carry them,
    the status reports them, the pod's arguments are `args()`, and `vllmfit plan` and the webhook
    read them back from a status as they are: nothing converts them."""

    max_model_len: int = Field(description="--max-model-len")
    max_num_seqs: int = Field(description="--max-num-seqs")
    gpu_memory_utilization: float = Field(description="--gpu-memory-utilization (per process, see docs)")
    kv_cache_memory_bytes: int | None = Field(
        default=None, description="--kv-cache-memory-bytes: the KV cache reservation in bytes, when injected."
    )
    max_num_batched_tokens: int | None = Field(default=None, description="--max-num-batched-tokens, if set")

    def to_json(self) -> dict[str, object]:
        """The `flags` object of `vllmfit estimate` and `vllmfit plan` JSON."""
        return {
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "args": self.args(),
        }

    def args(self) -> list[str]:
        """The `vllm serve` arguments vllmfit injects."""
        out = [
            f"--max-model-len={self.max_model_len}",
            f"--max-num-seqs={self.max_num_seqs}",
            f"--gpu-memory-utilization={self.gpu_memory_utilization:.{defaults.UTILIZATION_DECIMALS}f}",
        ]
        if self.max_num_batched_tokens:
            out.append(f"--max-num-batched-tokens={self.max_num_batched_tokens}")
        if self.kv_cache_memory_bytes:  # 0 (an embedder's): vLLM would profile; nothing to pin
            out.append(f"--kv-cache-memory-bytes={self.kv_cache_memory_bytes}")
        return out


class KvCacheStatus(_Model):
    """The KV cache granted, and the concurrency it buys."""

    bytes: int = Field(description="KV cache per GPU.")
    tokens: int = Field(description="KV tokens granted (never fewer than requested).")
    granted_by: str | None = Field(
        default=None, description="Which rule granted it, e.g. 'maxNumSeqs 4 x maxModelLen 1024' (no kvCache: "
        "between the cluster's default request and maxNumSeqs x maxModelLen, a fair share of the GPU, clamped "
        "to the room left)."
    )
    request_tokens: int | None = Field(
        default=None, ge=0, description="KV tokens of the request: what placement needs, the floor it keeps "
        "(kvCache, else the cluster's default, a few requests of maxModelLen)."
    )
    request_bytes: int | None = Field(
        default=None, ge=0, le=limits.MAX_GPU_MEMORY_BYTES, description="KV cache per GPU of the request; "
        "bytes - requestBytes is what it could give back to a newcomer."
    )
    limit_tokens: int | None = Field(
        default=None, ge=0, description="KV tokens of the limit, maxNumSeqs requests of maxModelLen: the most "
        "its scheduler can hold."
    )
    concurrency_at_max_model_len: float = Field(description="Requests of maxModelLen tokens held at once.")
    typical_length: int | None = Field(default=None, description="The typical request length asked for.")
    concurrency_at_typical_length: float | None = Field(
        default=None, description="Requests of typicalLength tokens held at once."
    )


class GpuMemory(_Model):
    """Predicted memory of this deployment on one GPU (the ledger entry)."""

    node: str = Field(description="Node name.")
    index: int = Field(ge=0, description="GPU index.")
    replica: int = Field(default=0, ge=0, le=limits.MAX_REPLICAS, description="Replica number.")
    weights_bytes: int = Field(ge=0, le=limits.MAX_GPU_MEMORY_BYTES, description="Model weights.")
    kv_cache_bytes: int = Field(ge=0, le=limits.MAX_GPU_MEMORY_BYTES, description="KV cache reservation.")
    activation_bytes: int = Field(ge=0, le=limits.MAX_GPU_MEMORY_BYTES, description="Activation peak.")
    overhead_bytes: int = Field(ge=0, le=limits.MAX_GPU_MEMORY_BYTES, description="CUDA context, NCCL, non-torch memory and CUDA graphs.")
    total_bytes: int = Field(ge=0, le=limits.MAX_GPU_MEMORY_BYTES, description="Everything this process may use on the GPU.")
    learned_bytes: int | None = Field(
        default=None, ge=0, le=limits.MAX_GPU_MEMORY_BYTES,
        description="Booked above the prediction because this configuration used more at an earlier start "
        "(the operator's learned records); included in totalBytes.",
    )
    observed_excess_bytes: int | None = Field(
        default=None, ge=0, le=limits.MAX_GPU_MEMORY_BYTES,
        description="Booked above the prediction because the node agent measured more once this replica had "
        "started (observed + margin - prediction); included in totalBytes.",
    )
    kv_cache_range_bytes: list[int] | None = Field(
        default=None,
        min_length=2,
        max_length=2,
        description="What vLLM is predicted to log as Available KV cache memory, [low, high]: the reservation "
        "is the floor; the band is measured per architecture class on real start-up logs.",
    )


class GpuHeadroom(_Model):
    """A GPU this deployment sits on, with all its neighbours counted."""

    node: str = Field(description="Node name.")
    index: int = Field(description="GPU index.")
    budget_bytes: int = Field(description="utilization x capacity - reserve.")
    used_bytes: int = Field(description="Sum over all deployments on the GPU, plus foreign use.")
    headroom_bytes: int = Field(description="budget - used.")


class ObservedMemory(_Model):
    """Memory the node agent measured for this deployment's processes on one GPU."""

    node: str = Field(description="Node name.")
    index: int = Field(description="GPU index.")
    used_bytes: int = Field(description="Observed bytes (NVML, summed over this deployment's processes).")
    predicted_bytes: int = Field(description="Predicted total bytes on this GPU.")
    drift_bytes: int = Field(description="observed - predicted (positive: uses more than predicted).")
    sampled_at: str = Field(description="When the agent sampled it (RFC 3339).")


class VLLMDeploymentStatus(_Model):
    """What vllmfit decided and observed. Written by the operator only."""

    phase: Phase = Field(default="Pending", description="Pending, Admitted, Running, Rejected, Unschedulable or Failed.")
    observed_generation: int | None = Field(default=None, description="Spec generation last acted upon.")
    replicas: int = Field(
        default=0, ge=0, description="Replicas placed and running as Deployments (the scale subresource's status)."
    )
    ready_replicas: int = Field(default=0, ge=0, description="Replicas whose vLLM pod is ready (serving).")
    ready: str | None = Field(
        default=None, description="readyReplicas/spec.replicas, e.g. 1/2 (the READY printer column)."
    )
    selector: str | None = Field(
        default=None,
        description="Label selector of its vLLM pods (the scale subresource's labelSelectorPath, read by HPA).",
    )
    vllm_version: str | None = Field(default=None, description="vLLM version the memory model used.")
    node: str | None = Field(
        default=None, description="Node(s) of the replicas (and of their workers), comma-separated (printer column)."
    )
    gpu_list: str | None = Field(
        default=None,
        description="GPU indices, comma-separated; replicas separated by ';', a replica's pods across nodes by '+' "
        "(printer column).",
    )
    placement: list[ReplicaPlacement] = Field(default_factory=list, description="Where each replica runs.")
    flags: Flags | None = Field(default=None, description="Computed vLLM flags.")
    kv_cache: KvCacheStatus | None = Field(default=None, description="KV cache granted and the concurrency it buys.")
    memory: list[GpuMemory] = Field(default_factory=list, description="Predicted memory per GPU (ledger entries).")
    gpus: list[GpuHeadroom] = Field(default_factory=list, description="Headroom of the GPUs it sits on.")
    headroom: str | None = Field(default=None, description="Smallest headroom among its GPUs, human-readable.")
    observed: list[ObservedMemory] = Field(default_factory=list, description="Observed vs predicted memory per GPU.")
    pod_uids: list[str] = Field(default_factory=list, description="UIDs of its vLLM pods (to attribute GPU processes).")
    reasons: list[str] = Field(default_factory=list, description="Why it does not fit: nodes counted per cause, like the kube-scheduler.")
    suggestions: list[str] = Field(default_factory=list, description="Changes that would make it fit, each checked.")
    warnings: list[str] = Field(default_factory=list, description="Warnings from admission.")
    conditions: list[Condition] = Field(default_factory=list, description="Admitted, Placed, Ready, MemoryDrift.")
