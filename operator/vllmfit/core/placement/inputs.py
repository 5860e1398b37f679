"""What placement works on: GPU slots, nodes and requests (a VLLMDeployment with its model facts),
and the memory settings a spec asks for."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from vllmfit.core import defaults, memory
from vllmfit.core.memory import Settings
from vllmfit.core.model.facts import GpuType, ModelArch, once
from vllmfit.core.observe import attribution
from vllmfit.core.placement.taints import Taint, Toleration, tolerations_of, untolerated
from vllmfit.core.spec.api import KvCacheSpec, VLLMDeployment, VLLMDeploymentSpec

DecisionPhase = Literal["Admitted", "Rejected", "Unschedulable"]
GpuLookup = Callable[[str, "int | None"], GpuType]
GpuKey = tuple[str, int]  # (node, index)

# --- Inputs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuSlot:
    """One schedulable unit of a node: a whole GPU, or a MIG slice (index = observe.unit_index)."""

    node: str
    index: int
    gpu: GpuType
    uuid: str | None = None
    foreign_bytes: int = 0  # used by processes vllmfit does not manage
    mig: bool = False
    policy: memory.BudgetPolicy = memory.DEFAULT_POLICY  # the node pool's, else the cluster's

    @property
    def capacity_bytes(self) -> int:
        return self.gpu.cuda_total_bytes

    @once
    def budget_bytes(self) -> int:
        return self.policy.budget(self.capacity_bytes)

    @property
    def label(self) -> str:
        return gpu_label(self.index)


def gpu_label(index: int) -> str:
    """'GPU 3', or 'GPU 2 MIG 1' for MIG slice 1 of GPU 2 (unit index 3001)."""
    g, m = attribution.split_unit_index(index)
    return f"GPU {g}" if m is None else f"GPU {g} MIG {m}"


def where(node: str, gpus: Sequence[int]) -> str:
    """'node-a GPU 0,1' / 'node-d GPU 2 MIG 0': a group, for messages."""
    if len(gpus) == 1:
        return f"{node} {gpu_label(gpus[0])}"
    if all(0 <= i < attribution.MIG_UNIT_BASE for i in gpus):  # whole GPUs: their indices (a 1,000-replica message)
        return f"{node} GPU {','.join(map(str, gpus))}"
    return f"{node} GPU {','.join(gpu_label(i).removeprefix('GPU ') for i in gpus)}"


@dataclass(frozen=True)
class NodeInfo:
    name: str
    labels: Mapping[str, str]
    gpus: tuple[GpuSlot, ...]
    warnings: tuple[str, ...] = ()
    error: str | None = None  # why nothing may be placed here (an invalid budget policy label)
    taints: tuple[Taint, ...] = ()  # spec.taints (core.placement.taints)
    unschedulable: bool = False  # spec.unschedulable (cordoned)
    unsafe: str | None = None  # why no binding vllmfit has can hold its GPUs (core.placement.nodes.binding_problem)

    def selected_as(self, other: NodeInfo) -> bool:
        """Whether every node selection treats this node as `other` (a nodeSelector, affinity,
        taints and cordon, a budget policy, GPU types and counts: what the ledger's selection cache
        holds): the two differ at most in foreign use, GPU UUIDs and warnings."""
        return (self.name == other.name and self.labels == other.labels and self.taints == other.taints
                and self.unschedulable == other.unschedulable and self.unsafe == other.unsafe
                and self.error == other.error and len(self.gpus) == len(other.gpus)
                and all((a.node, a.index, a.gpu, a.mig, a.policy) == (b.node, b.index, b.gpu, b.mig, b.policy)
                        for a, b in zip(self.gpus, other.gpus, strict=True)))

    def refuses(self, tolerations: tuple[Toleration, ...]) -> str | None:
        """Why this node takes no new pod with these tolerations (no safe GPU binding, cordon,
        untolerated taint), in the kube-scheduler's way of counting nodes."""
        if self.unsafe:
            return self.unsafe
        if not self.taints and not self.unschedulable:
            return None
        return untolerated(self.taints, self.unschedulable, tolerations)

    def one_type(self, whole: bool) -> tuple[GpuType, int] | None | bool:
        """(its one GPU type, how many) when every GPU of the node (`whole`: every whole GPU, MIG
        slices left out, as groups of several GPUs use them) is of one type; False when there are
        several types, None when there are none. Computed once per node (a refusal's causes count
        nodes by it: core.placement.summary)."""
        return self._one_type[whole]

    @once
    def _one_type(self) -> tuple[tuple[GpuType, int] | None | bool, tuple[GpuType, int] | None | bool]:
        t = self.gpus[0].gpu if self.gpus else None
        if t is not None and all(sl.gpu is t and not sl.mig for sl in self.gpus):  # most nodes: one catalog type
            return (t, len(self.gpus)), (t, len(self.gpus))
        out: list[tuple[GpuType, int] | None | bool] = []
        for whole in (False, True):
            types: dict[GpuType, int] = {}
            for sl in self.gpus:
                if not (whole and sl.mig):
                    types[sl.gpu] = types.get(sl.gpu, 0) + 1
            out.append(next(iter(types.items())) if len(types) == 1 else (None if not types else False))
        return out[0], out[1]

    @once
    def held_back(self) -> tuple[tuple[str, str, str, str], ...]:
        """(policy source, rule, GPU product, bytes held back as shown) per product, for refusals."""
        return tuple(sorted({(sl.policy.source, sl.policy.rule, sl.gpu.product,
                              memory.fmt_gib(sl.policy.held_back(sl.capacity_bytes))) for sl in self.gpus}))


@dataclass(frozen=True)
class Request:
    """A VLLMDeployment to place: its spec, its resolved model facts, and an order key."""

    key: str  # "namespace/name"
    spec: VLLMDeploymentSpec
    model: ModelArch
    order: tuple[str, str] = ("", "")  # (creationTimestamp, key) or (UNTIMED, input position): earlier first
    learned: tuple[tuple[str, int, int, str], ...] = ()  # memory.learned.for_model: this model's over-runs


def settings_from_spec(spec: VLLMDeploymentSpec, policy: memory.Policy = "vllm",
                       grant: memory.KvGrant = memory.DEFAULT_KV_GRANT) -> Settings:
    """The memory model's settings for a spec; the vLLM version comes from the image tag. No KV
    request: at most maxNumSeqs x maxModelLen, else the cluster's default `grant`, clamped to the
    room left (memory.default_grant). Equal values give the same (interned) Settings object, built
    and hashed once: sizing caches then find it by identity."""
    kv, lora = spec.kv_cache, spec.lora
    return _settings(
        spec.tensor_parallel_size, spec.pipeline_parallel_size, spec.dtype, spec.quantization, spec.kv_cache_dtype,
        spec.max_model_len, spec.max_num_seqs, spec.max_num_batched_tokens, spec.gpu_memory_utilization,
        spec.enforce_eager, spec.vllm_version or spec.image, policy, spec.strict,
        kv.tokens if kv else None, kv.memory_bytes if kv else None, kv.concurrency if kv else None,
        kv.typical_length if kv else None, kv.grow if kv else _KV_GROW,
        lora.max_loras if lora else None, lora.max_lora_rank if lora else defaults.LORA_MAX_RANK,
        lora.lora_dtype if lora else "auto", spec.cpu_offload_bytes, grant,
    )


_KV_GROW = KvCacheSpec.model_fields["grow"].default  # read once: pydantic's class property costs ~1 us a read


@functools.lru_cache(maxsize=4096, typed=True)  # typed: 1 and 1.0 (equal keys) stay apart, as the specs do
def _settings(tp: int, pp: int, dtype: str, quantization: str | None, kv_cache_dtype: str, max_model_len: int | None,
              max_num_seqs: int | None, max_num_batched_tokens: int | None, gpu_memory_utilization: float | None,
              enforce_eager: bool, vllm_version: str, policy: memory.Policy, strict: bool, kv_tokens: int | None,
              kv_bytes: int | None, kv_concurrency: int | None, typical_len: int | None, kv_grow: bool,
              lora_max_loras: int | None, lora_max_rank: int, lora_dtype: str, cpu_offload_bytes: int,
              grant: memory.KvGrant) -> Settings:
    """settings_from_spec's Settings from the spec's values: a pure function of its arguments."""
    return memory.default_grant(Settings(
        tp=tp, pp=pp, dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
        max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager, vllm_version=vllm_version,
        policy=policy, strict=strict, kv_tokens=kv_tokens, kv_bytes=kv_bytes, kv_concurrency=kv_concurrency,
        typical_len=typical_len, kv_grow=kv_grow, lora_max_loras=lora_max_loras, lora_max_rank=lora_max_rank,
        lora_dtype=lora_dtype, cpu_offload_bytes=cpu_offload_bytes,
    ), grant)


def settings_of(req: Request, policy: memory.Policy = "vllm",
                grant: memory.KvGrant = memory.DEFAULT_KV_GRANT) -> Settings:
    """The settings placement sizes `req` with: its spec's (`settings_from_spec`) and the over-runs
    learned for its model (issue 34: a configuration that over-ran books what it used). Built once
    per review and passed on: the decision, the replicas bound and the fixes size the same."""
    s = settings_from_spec(req.spec, policy, grant)
    return replace(s, learned=req.learned) if req.learned else s


def refusal(node: NodeInfo, spec: VLLMDeploymentSpec) -> str | None:
    """Why `node` takes no new replica of `spec` for its taints or cordon (None: it may)."""
    return node.refuses(tolerations_of(spec)) if node.taints or node.unschedulable or node.unsafe else None


def request_from_object(obj: VLLMDeployment, model: ModelArch, position: int = 0) -> Request:
    """A request ordered by creationTimestamp (then name); one without (a hand-written file for
    `plan`) after every timestamped one, in input order (`position`: its place in the input)."""
    ts = obj.metadata.creation_timestamp
    return Request(obj.key, obj.spec, model, (ts, obj.key) if ts else (UNTIMED, f"{position:012d}"))


UNTIMED = "~"
"""The order key of a request without creationTimestamp: after every timestamp (they start with a digit)."""
