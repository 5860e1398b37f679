"""The KV cache: bytes per token and layer, pages, KV cache groups, blocks per request, and what
vLLM logs as KV tokens and concurrency (vllm-memory-accounting.md sections 5-6).

Hybrid models (Mamba / Mamba2, short conv, Gated DeltaNet, linear attention next to attention
layers) follow vLLM's hybrid KV cache manager:
- a recurrent layer holds one state page per sequence: conv + temporal state, per TP rank
  (layers/mamba/mamba_utils.py MambaStateShapeCalculator; v1/kv_cache_interface.py MambaSpec);
- the attention block size grows until one attention page >= one state page, and the state page
  is padded to equal it (0.21+: platforms/interface.py Platform._align_hybrid_block_size;
  0.11/0.15: models/config.py HybridAttentionMambaModelConfig.verify_and_update_config);
- layers form KV groups of g slots (v1/core/kv_cache_utils.py _get_kv_cache_groups_uniform_page_size);
  a block is g pages; a request needs ceil(L / bs) blocks per attention group and 1 (mode
  "none") or 2 + checkpoint blocks (mode "align", 0.33's default with prefix caching) per
  state group (MambaSpec.max_memory_usage_bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from vllmfit.core import defaults
from vllmfit.core.memory.types import Settings
from vllmfit.core.memory.versions import VllmVersion
from vllmfit.core.memory.weights import activation_dtype_bytes
from vllmfit.core.model.facts import DTYPE_BYTES, GpuType, ModelArch, ceil_div

# --- KV cache ----------------------------------------------------------------------------------


def kv_dtype_bytes(model: ModelArch, s: Settings) -> int:
    if s.kv_cache_dtype.startswith("fp8"):
        return 1
    if s.kv_cache_dtype == "auto" and model.quant and model.quant.kv_fp8:
        return 1
    if s.kv_cache_dtype in DTYPE_BYTES:
        return DTYPE_BYTES[s.kv_cache_dtype]
    return activation_dtype_bytes(model, s)


def kv_heads_per_rank(model: ModelArch, tp: int) -> int:
    return max(1, model.num_kv_heads // tp)


INDEXER_QUANT_BLOCK = 128
"""The sparse-MLA indexer stores its keys as fp8 with one 4-byte scale per 128 elements, uint8
(models/deepseek_v32/attention.py: head_dim + head_dim // quant_block_size * 4)."""


FP8_DS_MLA_BYTES = 656
"""Sparse MLA with an fp8 KV cache stores DeepSeek's "fp8_ds_mla" layout: 512 fp8 latent values,
4 float32 scales, 64 bf16 rope values (v1/attention/backends/mla/flashmla_sparse.py; the 0.33
oracle: GLM-5 fp8 pages are 78 x 64 x (656 + 132) bytes)."""


def kv_bytes_per_token_layer(model: ModelArch, s: Settings, kind: str = "full") -> int:
    """KV bytes of one token in one attention layer on one TP rank (vllm-memory-accounting §5):
    kvh_rank x (head_size + head_size_v) x d (AttentionSpec.page_size_bytes / block_size); a
    sliding layer with its own shapes (MiMo-V2 swa_*) uses them; MLA: one latent vector, not
    divided by TP, plus the sparse-MLA indexer's key cache."""
    d = kv_dtype_bytes(model, s)
    if model.is_mla:  # one latent vector per token, not divided by TP
        indexer = model.indexer_head_dim + model.indexer_head_dim // INDEXER_QUANT_BLOCK * 4
        if model.is_sparse_mla and d == 1:  # "fp8_ds_mla": 512 fp8 + 4 fp32 scales + 64 bf16 rope
            return FP8_DS_MLA_BYTES + indexer
        return model.head_dim * d + indexer
    heads, hk, hv = model.num_kv_heads, model.head_dim, model.kv_head_dim_v or model.head_dim
    if kind == "full" and model.full_head_dim:
        heads = model.full_num_kv_heads or heads
        hk = hv = model.full_head_dim
    if kind == "sliding" and model.swa_num_kv_heads:
        heads = model.swa_num_kv_heads
        hk = model.swa_head_dim or hk
        hv = model.swa_head_dim_v or hk
    return max(1, heads // s.tp) * (hk + hv) * d


@dataclass(frozen=True)
class KvLayout:
    """How vLLM lays out the KV cache of one rank: block pool and per-request demand."""

    block_size: int
    block_bytes: int  # P_blk: one block across every layer slot of the rank
    full_groups: int  # full-attention groups (each costs ceil(L / bs) blocks per request)
    sliding_groups: int  # sliding-window groups (window-bounded blocks per request)
    window: int | None
    version: VllmVersion
    pooling: bool = False
    state_groups: int = 0  # recurrent-state groups (hybrid models)
    state_blocks: int = 0  # blocks one request holds in each state group
    state_page_bytes: int = 0  # one layer's state page before padding (per rank)
    full_scale: int = 1  # a kind whose page is smaller holds scale x block_size tokens per block
    sliding_scale: int = 1  # (vLLM unify_kv_cache_spec_page_size: the page sizes are made equal)

    @property
    def full_block_size(self) -> int:
        return self.block_size * self.full_scale

    @property
    def sliding_block_size(self) -> int:
        return self.block_size * self.sliding_scale

    @property
    def min_block_size(self) -> int:
        sizes = [self.full_block_size] * bool(self.full_groups) + [self.sliding_block_size] * bool(self.sliding_groups)
        return min(sizes or [self.block_size])

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token of context, as if every attention group were full attention
        (recurrent-state groups do not grow with the context)."""
        return (self.block_bytes * self.full_groups // self.full_block_size
                + self.block_bytes * self.sliding_groups // self.sliding_block_size)

    @property
    def state_bytes_per_request(self) -> int:
        """Pool bytes one request's recurrent state holds, whatever its length."""
        return self.state_groups * self.state_blocks * self.block_bytes

    @property
    def groups(self) -> int:
        return self.full_groups + self.sliding_groups + self.state_groups

    def blocks_per_request(self, length: int, batched_tokens: int, pp: int = 1) -> int:
        blocks = self.full_groups * ceil_div(length, self.full_block_size)
        if self.sliding_groups and self.window:
            in_flight = batched_tokens * ((pp + 1) if self.version.at_least(33) else 1)
            per = ceil_div(min(self.window - 1 + in_flight, length), self.sliding_block_size) + 1
            blocks += self.sliding_groups * per
        elif self.sliding_groups:
            blocks += self.sliding_groups * ceil_div(length, self.sliding_block_size)
        return blocks + self.state_groups * self.state_blocks

    def bytes_for(self, length: int, seqs: int, batched_tokens: int, pp: int = 1) -> int:
        """KV bytes that hold `seqs` requests of `length` tokens, block-rounded, plus the null block."""
        blocks = seqs * self.blocks_per_request(length, batched_tokens, pp) + 1
        return blocks * self.block_bytes

    @property
    def _window_blocks(self) -> int:
        """The block a window-bounded group adds because its window may not start at a block's
        start (vLLM SlidingWindowSpec.max_memory_usage_bytes: cdiv(tokens, block) + 1)."""
        return self.sliding_groups if self.window else 0

    def bytes_for_tokens(self, tokens: int) -> int:
        """KV bytes of a pool that holds `tokens` tokens in every group, plus the null block; a
        window-bounded group's extra block (`_window_blocks`) counts, so a pool of maxModelLen
        tokens holds one request of maxModelLen, as vLLM's start-up check counts it."""
        attn = self.full_groups * ceil_div(tokens, self.full_block_size) + \
            self.sliding_groups * ceil_div(tokens, self.sliding_block_size)
        state = self.state_groups * ceil_div(tokens, self.block_size)
        return (attn + state + self._window_blocks + 1) * self.block_bytes

    def pool_tokens(self, kv_bytes: int) -> int:
        """Tokens `kv_bytes` hold in every group (the null block, taken from the pool by vLLM's
        BlockPool, and the window blocks excluded): what a KV request in tokens is granted, so
        `bytes_for_tokens(pool_tokens(b)) <= b`."""
        if not self.groups or not self.block_bytes:
            return 0
        return max(self.num_blocks(kv_bytes) - 1 - self._window_blocks, 0) // self.groups * self.min_block_size

    def concurrency(self, kv_bytes: int, length: int, batched_tokens: int, pp: int = 1) -> float:
        """Requests of `length` tokens the pool holds at once (the null block excluded)."""
        per = self.blocks_per_request(length, batched_tokens, pp)
        return max(self.num_blocks(kv_bytes) - 1, 0) / per if per else 0.0

    def num_blocks(self, kv_bytes: int) -> int:
        return max(kv_bytes // self.block_bytes, 0) if self.block_bytes else 0

    def tokens(self, kv_bytes: int, length: int, batched_tokens: int, pp: int = 1) -> tuple[int, float]:
        """(KV cache tokens, max concurrency) vLLM logs for `kv_bytes` of KV memory."""
        blocks = self.num_blocks(kv_bytes)
        if not blocks or not self.groups:
            return 0, 0.0
        per_req = self.blocks_per_request(length, batched_tokens, pp)
        # every block, the null block included: get_max_concurrency_for_kv_cache_config divides
        # num_blocks (0.33 too; its null-block reservation is in the fit check, not in this log)
        concurrency = blocks / per_req if per_req else 0.0
        if self.version.tokens_from_concurrency or self.sliding_groups:
            # hybrids from 0.21 too: "GPU KV cache size" is concurrency x L, not blocks x block size
            return int(concurrency * length), concurrency
        return blocks // self.groups * self.min_block_size, concurrency

    def max_length(self, kv_bytes: int, seqs: int, batched_tokens: int, limit: int, pp: int = 1) -> int:
        """Largest multiple of the block size <= limit such that `seqs` requests fit in kv_bytes."""
        lo, hi = 0, limit // self.block_size
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.bytes_for(mid * self.block_size, seqs, batched_tokens, pp) <= kv_bytes:
                lo = mid
            else:
                hi = mid - 1
        return lo * self.block_size

    def max_seqs(self, kv_bytes: int, length: int, batched_tokens: int, pp: int = 1) -> int:
        per = self.blocks_per_request(length, batched_tokens, pp) * self.block_bytes
        return max((kv_bytes - self.block_bytes) // per, 0) if per else 0


# --- Hybrid models: recurrent state pages -----------------------------------------------------

KERNEL_MIN_BLOCK = 16
"""Smallest kernel block of FlashAttention, FlashInfer and Triton attention (0.21+
`get_supported_kernel_block_sizes`; 0.11 HybridAttentionMambaModelConfig uses 16 too)."""
SPARSE_MLA_BLOCK = 64
"""Block size of the sparse-MLA backends (v1/attention/backends/mla/flashmla_sparse.py
get_supported_kernel_block_sizes: [64]); the indexer cache follows it."""
MLA_BLACKWELL_BLOCK = 32
"""FlashInfer MLA, vLLM's MLA backend on SM100 (vllm-memory-accounting §4; oracle 0.33: 32)."""
FA4_BLOCK = 64
MLA_OLD_BLOCK = 128
MLA_MIN_BLOCK = 128
"""MLA backends' block alignment in _align_hybrid_block_size (0.21+)."""
GDN_CHECKPOINT_ALIGNMENT = 64
"""FLASHINFER_GDN_CHECKPOINT_ALIGNMENT (v1/attention/backends/gdn_attn.py): align mode with the
flashinfer GDN prefill backend, vLLM's default on SM90 and SM100 (and one checkpoint block per
request); not below SM90 (`_gdn_checkpoints`; both checked with the vLLM 0.33 oracle)."""


def state_dtype_bytes(model: ModelArch, s: Settings, version: VllmVersion) -> tuple[int, int]:
    """(conv state, temporal state) bytes per element (MambaStateDtypeCalculator, "auto" cache
    dtypes; model-file overrides in models/config.py)."""
    conv = activation_dtype_bytes(model, s)
    spec = model.state
    ssm = conv
    if spec is None:
        return conv, ssm
    if spec.dtype_rule == "nemotron_h":  # NemotronHForCausalLMConfig.update_mamba_ssm_cache_dtype
        if version.at_least(21):
            ssm = DTYPE_BYTES.get(spec.ssm_dtype if spec.ssm_dtype != "auto" else "float32", 4)
        elif version.at_least(15):
            ssm = DTYPE_BYTES.get(spec.ssm_dtype if spec.ssm_dtype != "auto" else "float16", 2)
    elif spec.dtype_rule == "qwen3_5" and version.at_least(21) and spec.ssm_dtype != "auto":
        ssm = DTYPE_BYTES.get(spec.ssm_dtype, conv)  # Qwen3_5ForConditionalGenerationConfig: mamba_ssm_dtype
    return conv, ssm


def state_page_bytes(model: ModelArch, s: Settings, version: VllmVersion) -> int:
    """One recurrent layer's state for one sequence on one TP rank (MambaSpec.page_size_bytes)."""
    if model.state is None:
        return 0
    conv_el, ssm_el = model.state.elements(s.tp)
    conv_b, ssm_b = state_dtype_bytes(model, s, version)
    return conv_el * conv_b + ssm_el * ssm_b


def prefix_caching_mode(version: VllmVersion) -> str:
    """vLLM's mamba cache mode with default flags: "none" up to 0.21 (hybrid prefix caching off,
    config/model.py is_prefix_caching_supported), "align" in 0.33 (on by default). Versions between
    the two are not modelled; they get "align", which holds more blocks per request (never
    over-promises)."""
    return "align" if version.at_least(22) else "none"


def _group_size(n_a: int, n_b: int, version: VllmVersion) -> int:
    small, large = min(n_a, n_b), max(n_a, n_b)
    return large if large < version.hybrid_group_ratio * small else small


def _gdn_checkpoints(gpu: GpuType | None) -> bool:
    """The flashinfer GDN prefill backend (and its checkpoint alignment) runs on SM90 and newer;
    vLLM 0.33 on A100 / L40S aligns without it (oracle). Unknown GPU: aligned (larger blocks)."""
    cc = gpu.compute_capability if gpu is not None else None
    return cc is None or cc >= (9, 0)


def _hybrid_layout(model: ModelArch, s: Settings, version: VllmVersion, n_attn: int,
                   gpu: GpuType | None = None) -> KvLayout:
    spec = model.state
    assert spec is not None
    n_state = math.ceil(model.num_state_layers / s.pp)
    page_m = state_page_bytes(model, s, version)
    align = prefix_caching_mode(version) == "align"
    checkpoints = spec.prefill_checkpoint_blocks if (spec.kind != "gdn" or _gdn_checkpoints(gpu)) else 0
    state_blocks = (2 + checkpoints) if align else 1
    if n_attn == 0:  # recurrent layers only: one group of identical specs, pages unpadded
        return KvLayout(s.block_size, n_state * page_m, 0, 0, None, version, model.pooling, 1, state_blocks, page_m)
    attn_1tok = kv_bytes_per_token_layer(model, s)
    a = max(KERNEL_MIN_BLOCK, s.block_size)
    if model.is_mla and version.at_least(21):
        a = max(a, MLA_MIN_BLOCK)
    if align and spec.kind == "gdn" and _gdn_checkpoints(gpu):
        a = math.lcm(a, GDN_CHECKPOINT_ALIGNMENT)
    bs = max(s.block_size, a * ceil_div(page_m, a * attn_1tok))
    g = _group_size(n_attn, n_state, version)
    return KvLayout(bs, g * bs * attn_1tok, ceil_div(n_attn, g), 0, None, version, model.pooling,
                    ceil_div(n_state, g), state_blocks, page_m)


def backend_block_size(model: ModelArch, s: Settings, gpu: GpuType | None,
                       version: VllmVersion | None = None) -> int:
    """The KV block size vLLM's attention backend takes on this GPU (update_block_size_for_backend:
    the backends' preferred size; checked against vLLM 0.33 in tests/data/vllm-oracle):
    sparse MLA (FlashMLA sparse) 64; MLA on Blackwell (SM10x) 32 (FlashInfer MLA); MLA with an fp8
    KV cache on Hopper 64 (FlashMLA); other MLA (FlashAttention MLA, Triton MLA) and every other
    attention backend 16."""
    cc = gpu.compute_capability if gpu is not None else None
    if model.is_sparse_mla:
        return max(s.block_size, SPARSE_MLA_BLOCK)
    if not model.is_mla:
        # FlashAttention 4 pages: 64 tokens for an fp8 KV cache with 512-wide heads on SM90
        # (_get_sm90_fa4_fp8_kv_block_size) and for 256-wide heads on SM100 (the hd256 kernel;
        # sliding-window layers take its smallest page) (v1/attention/backends/flash_attn.py)
        heads = {model.head_dim, model.full_head_dim, model.swa_head_dim} - {0}
        if cc is not None and cc[0] == 9 and 512 in heads and kv_dtype_bytes(model, s) == 1:
            return max(s.block_size, FA4_BLOCK)
        if cc is not None and cc[0] == 10 and 256 in heads and not model.is_hybrid_state:
            return max(s.block_size, FA4_BLOCK)
        return s.block_size
    if cc is None or (version is not None and not version.at_least(21)):
        # 0.11-0.19 chose FlashMLA (64) on Hopper and CUTLASS MLA (128) on Blackwell and elsewhere
        # (0.11 oracle); unknown GPU or version before 0.21: the largest (fewer, larger blocks never
        # over-promise by rounding)
        return s.block_size if gpu is None else max(s.block_size, MLA_OLD_BLOCK)
    if cc[0] == 10:
        return max(s.block_size, MLA_BLACKWELL_BLOCK)
    if cc == (9, 0) and kv_dtype_bytes(model, s) == 1:
        return max(s.block_size, SPARSE_MLA_BLOCK)
    return s.block_size


def kv_layout(model: ModelArch, s: Settings, version: VllmVersion, gpu: GpuType | None = None) -> KvLayout:
    """Page sizes and groups (vllm-memory-accounting §5-6), for the fullest PP stage; `gpu`
    picks the attention backend's block size (`backend_block_size`)."""
    if model.swa_attention_sinks and not version.at_least(33) and s.kv_cache_dtype != "auto":
        # vLLM 0.21's MiMo-V2 layers build their KV spec in the model dtype whatever
        # --kv-cache-dtype says (0.21 oracle: fp8 asked, bf16 pages)
        s = replace(s, kv_cache_dtype="auto")
    bs = backend_block_size(model, s, gpu, version) if (gpu is not None or model.is_sparse_mla) else s.block_size
    per_layer = kv_bytes_per_token_layer(model, s) * bs
    types = [t for t in model.layer_types if t]
    stage = ceil_div(len(types), s.pp)
    n_full = math.ceil(sum(1 for t in types if t == "full") / s.pp)
    n_slide = math.ceil(sum(1 for t in types if t == "sliding") / s.pp)
    if model.is_hybrid_state and not model.pooling:
        return _hybrid_layout(model, s, version, n_full + n_slide, gpu)
    if model.pooling and not model.layer_types:
        return KvLayout(bs, 0, 0, 0, None, version, pooling=True)
    if n_slide == 0 or n_full == 0:
        # one group holding every layer of the stage
        kind_sliding = n_full == 0 and n_slide > 0
        if kind_sliding:
            per_layer = kv_bytes_per_token_layer(model, s, "sliding") * bs
        return KvLayout(bs, stage * per_layer, 0 if kind_sliding else 1, 1 if kind_sliding else 0,
                        model.sliding_window, version, pooling=model.pooling)
    # hybrid: group size g = the smallest bucket (or the largest if max < ratio x min)
    small, large = min(n_full, n_slide), max(n_full, n_slide)
    g = large if large < version.hybrid_group_ratio * small else small
    # layers whose page is smaller hold more tokens per block, so that every page is equal
    # (v1/core/kv_cache_utils.py unify_kv_cache_spec_page_size; MiMo-V2: full 4 x 320, sliding 8 x 320)
    page_full = per_layer
    page_slide = kv_bytes_per_token_layer(model, s, "sliding") * bs
    page = max(page_full, page_slide)
    full_scale = page // page_full if page % page_full == 0 else 1
    slide_scale = page // page_slide if page % page_slide == 0 else 1
    return KvLayout(bs, g * page, ceil_div(n_full, g), ceil_div(n_slide, g), model.sliding_window, version,
                    pooling=model.pooling, full_scale=full_scale, sliding_scale=slide_scale)


def adr_kv_bytes_per_token(model: ModelArch, s: Settings) -> int:
    """ADR-0002: 2 x layers x kvHeads x headDim x bytesPerKvElem / tp x (1 + kvOverheadPct),
    with headDim = hiddenSize / heads."""
    head_dim = model.hidden_size // model.num_attention_heads
    d = 1 if s.kv_cache_dtype.startswith("fp8") else 2
    raw = 2 * model.num_layers * model.num_kv_heads * head_dim * d / s.tp
    return int(raw * (1 + defaults.KV_OVERHEAD))
