"""The memory core's data: the settings of one deployment in, its footprint, flags and sizing out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from vllmfit.core import defaults, limits
from vllmfit.core.defaults import GIB
from vllmfit.core.memory.versions import VllmVersion
from vllmfit.core.model.facts import GpuType, ModelArch, hash_once, once, quick_init, state_without_hash
from vllmfit.core.spec.status import Flags  # the one flag type: what sizing computes is what status carries

Policy = Literal["vllm", "adr"]

# --- Inputs ------------------------------------------------------------------------------------


@quick_init
@dataclass(frozen=True)
class Settings:
    """The memory-relevant settings of one deployment (vLLM's flags, or unset = computed)."""

    __hash__ = hash_once
    __getstate__ = state_without_hash

    tp: int = 1
    pp: int = 1
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = False
    vllm_version: str = defaults.DEFAULT_VLLM_VERSION
    policy: Policy = "vllm"
    block_size: int = defaults.BLOCK_SIZE
    strict: bool = False  # refuse a model with layers vllmfit does not model (ModelArch.warnings)
    # The KV request (spec.kvCache): at most one of tokens, bytes, concurrency (x typical length).
    kv_tokens: int | None = None  # KV capacity in tokens
    kv_bytes: int | None = None  # KV capacity in bytes per GPU (--kv-cache-memory-bytes)
    kv_concurrency: int | None = None  # requests of typical_len tokens (typical_len unset: maxModelLen)
    typical_len: int | None = None  # a typical request's length, for kv_concurrency and status
    kv_grow: bool = False  # the KV cache may grow into the room the GPU group offers at placement
    # no spec.kvCache: the cluster's rule (sizing.default_grant, KvGrant.rule): "requests" (a fair
    # share) or "room"; None: the spec asks for its KV cache
    kv_default: str | None = None
    kv_default_requests: int = 0  # the request: this many full-length requests (at most maxNumSeqs)
    # spec.lora: adapter slots (None: no LoRA), their rank and dtype (--max-loras, --max-lora-rank, --lora-dtype)
    lora_max_loras: int | None = None
    lora_max_rank: int = defaults.LORA_MAX_RANK
    lora_dtype: str = "auto"
    cpu_offload_bytes: int = 0  # spec.cpuOffload: weight bytes per GPU kept in CPU memory (--cpu-offload-gb)
    # issue 34: learned records of this model (memory.learned): config key -> (predicted, observed, source)
    learned: tuple[tuple[str, int, int, str], ...] = field(default=(), repr=False)  # compared: sizings are cached

    @property
    def gpus(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True)
class KvGrant:
    """The cluster's rule for the KV cache of a spec without spec.kvCache. The request (what
    placement needs, the floor kept) is `requests` requests of the full maxModelLen, at most
    maxNumSeqs; the limit is maxNumSeqs x maxModelLen (vLLM's default maxNumSeqs when unset). The
    grant lies between: `rule` "requests", a fair share (the footprint grows to at most 1/`tenants` of
    its GPU's budget); "room", vLLM's own, the room left. `grants` False: every grant is its request
    (`plan` places every request before it grants)."""

    rule: str = defaults.DEFAULT_KV_GRANT
    requests: int = defaults.DEFAULT_KV_GRANT_REQUESTS
    tenants: int = defaults.DEFAULT_KV_TENANTS
    grants: bool = True

    def error(self) -> str | None:
        """Why this choice is invalid (one line), or None."""
        if self.rule not in defaults.KV_GRANT_RULES:
            return f"default KV grant {self.rule!r} must be one of {', '.join(defaults.KV_GRANT_RULES)}"
        if not 1 <= self.requests <= limits.MAX_KV_GRANT_REQUESTS:
            return f"default KV grant requests {self.requests} must be in [1, {limits.MAX_KV_GRANT_REQUESTS}]"
        if not 1 <= self.tenants <= limits.MAX_KV_TENANTS:
            return f"KV tenants per GPU {self.tenants} must be in [1, {limits.MAX_KV_TENANTS}]"
        return None

    def share(self, budget: int) -> int | None:
        """The most bytes a grant may grow a footprint to on a GPU of this budget (None: the room)."""
        return budget // self.tenants if self.rule == "requests" else None

    def room(self, room: int, request: int, budget: int, default: bool) -> int:
        """The bytes per GPU a growing KV cache may take where `room` is left on a GPU of `budget`,
        its footprint at its KV request being `request`: the room; for a `default` grant (a spec
        without kvCache) of rule `requests`, at most the fair `share`, never less than `request`;
        with `grants` off, the request alone. Placement and `vllmfit estimate` both ask it."""
        if not self.grants:
            return min(room, request)
        share = self.share(budget) if default else None
        return room if share is None else min(room, max(share, request))


DEFAULT_KV_GRANT = KvGrant()


# --- Outputs -----------------------------------------------------------------------------------


@quick_init
@dataclass(frozen=True)
class Footprint:
    """Bytes one vLLM process uses on one GPU."""

    weights: int
    kv_cache: int
    activation: int
    cuda_context: int  # CUDA context, NCCL, cuBLAS: resident before vLLM measures (outside R)
    non_torch: int  # non-torch growth during profiling
    cuda_graphs: int
    slack: int = 0  # rounding of --gpu-memory-utilization up to UTILIZATION_DECIMALS
    margin: int = 0  # the measured over-prediction band of the KV estimate (memory.margin), inside R
    kv_band_under: int = field(default=0, compare=False)  # how much more KV vLLM may find (range only)
    lora: int = field(default=0, compare=False)  # LoRA slots + punica metadata, included in weights (memory.lora)
    cpu_offloaded: int = field(default=0, compare=False)  # weight bytes in CPU memory, taken off weights
    learned: int = 0  # booked above the prediction: a learned record of this configuration (memory.learned)
    observed_excess: int = 0  # booked above the prediction: the agent measured more (placement.observed)

    @property
    def overhead(self) -> int:
        """Runtime overhead: CUDA context, NCCL, non-torch memory, CUDA graphs, rounding, margin."""
        return self.cuda_context + self.non_torch + self.cuda_graphs + self.slack + self.margin

    @property
    def kv_range(self) -> tuple[int, int]:
        """What vLLM is predicted to log as "Available KV cache memory": the reservation is the
        floor (the margin covers the largest measured over-prediction)."""
        return self.kv_cache, self.kv_cache + self.margin + self.kv_band_under

    @property
    def predicted(self) -> int:
        """What the memory model predicts (with a learned correction): the floor of the booking."""
        return self.weights + self.kv_cache + self.activation + self.overhead + self.learned

    @once
    def total(self) -> int:  # once per footprint: read on every search, booking and index change
        """What the ledger books: the prediction, or the observed footprint plus a margin when larger."""
        return self.predicted + self.observed_excess

    @property
    def non_kv(self) -> int:
        return self.total - self.kv_cache


@dataclass(frozen=True)
class VllmStartup:
    """What vLLM would log at start-up for exactly these settings (per GPU, worst rank)."""

    requested_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int
    cuda_graph_bytes: int
    kv_cache_bytes: int  # "Available KV cache memory"
    kv_cache_tokens: int
    num_gpu_blocks: int
    max_concurrency: float
    kv_cache_low_bytes: int = 0  # the measured band around kv_cache_bytes (memory.margin)
    kv_cache_high_bytes: int = 0


@quick_init
@dataclass(frozen=True)
class Sizing:
    """One deployment sized for one GPU group: the decision, as data."""

    fits: bool
    footprint: Footprint  # per GPU (the worst rank; every GPU of the group books this)
    flags: Flags | None
    kv_bytes_per_token: int
    kv_cache_tokens: int
    max_concurrency: float
    reasons: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    granted_tokens: int = 0  # KV tokens the reservation holds (block pool / groups x block size)
    typical_len: int | None = None  # the typical request length asked for, if any
    concurrency_typical: float | None = None  # requests of typical_len the KV cache holds at once
    grant: str = ""  # which rule granted the KV cache: "maxNumSeqs 4 x maxModelLen 1024" (sizing.grant_text)
    kv_above_request: int = 0  # KV bytes granted above the request: what a neighbour could give back
    request_tokens: int = 0  # KV tokens of the request (the floor kept; sizing.kv_request_bytes)
    limit_tokens: int = 0  # KV tokens of maxNumSeqs requests of maxModelLen (the most its scheduler holds)
    give_back: str = ""  # the spec change that shrinks it to its request: "kvCache.concurrency: 2"


def kv_json(z: Sizing) -> dict[str, object]:
    """The KV cache of a sizing as `estimate` and `plan` JSON show it (status.kvCache's fields): the
    tokens granted and by which rule, the request and the limit, each also in requests of the full
    maxModelLen, and the concurrency they buy."""
    length = z.flags.max_model_len if z.flags else 0
    return {
        "granted_tokens": z.granted_tokens,
        "granted_by": z.grant or None,
        "request_tokens": z.request_tokens or None,
        "limit_tokens": z.limit_tokens or None,
        "full_length_requests": {"request": z.request_tokens // length, "granted": z.granted_tokens // length,
                                 "limit": z.limit_tokens // length} if length and z.request_tokens else None,
        "concurrency_at_max_model_len": round(z.max_concurrency, 2),
        "typical_length": z.typical_len,
        "concurrency_at_typical_length": None if z.concurrency_typical is None else round(z.concurrency_typical, 2),
    }


@dataclass(frozen=True)
class Estimate:
    """`vllmfit estimate`: one deployment alone on empty GPUs of one type."""

    model: ModelArch
    gpu: GpuType
    settings: Settings
    version: VllmVersion
    sizing: Sizing
    budget_bytes: int
    reserve_bytes: int
    capacity_bytes: int
    vllm: VllmStartup | None
    suggestions: tuple[str, ...] = ()
    warnings: tuple[str, ...] = field(default=())
    policy: object = None  # the BudgetPolicy used (budget.BudgetPolicy; typed loosely: budget imports types)
    nodes: int = 1  # nodes one replica spans (tp x pp beyond the GPUs per node: one pod per node)
    stages: tuple[Footprint, ...] = ()  # pp > 1: one GPU of each pipeline stage (memory.stages)

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.sizing.footprint.total


class SpecError(ValueError):
    """An impossible combination of settings (message: one line with the fix)."""

def fmt_gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"
