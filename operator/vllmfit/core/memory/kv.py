"""The KV cache: bytes per token and layer, pages, KV cache groups, blocks per request, and what
vLLM logs as KV tokens and concurrency (vllm-memory-accounting.md sections 5-6)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllmfit.core import defaults
from vllmfit.core.memory.types import Settings
from vllmfit.core.memory.versions import VllmVersion
from vllmfit.core.memory.weights import activation_dtype_bytes
from vllmfit.core.modelarch import DTYPE_BYTES, ModelArch, ceil_div

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


def kv_bytes_per_token_layer(model: ModelArch, s: Settings) -> int:
    """KV bytes of one token in one attention layer on one TP rank (vllm-memory-accounting §5)."""
    d = kv_dtype_bytes(model, s)
    if model.is_mla:  # one latent vector per token, not divided by TP
        return model.head_dim * d
    return 2 * kv_heads_per_rank(model, s.tp) * model.head_dim * d


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

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token of context, as if every group were full attention."""
        return self.block_bytes * (self.full_groups + self.sliding_groups) // self.block_size

    @property
    def groups(self) -> int:
        return self.full_groups + self.sliding_groups

    def blocks_per_request(self, length: int, batched_tokens: int, pp: int = 1) -> int:
        bs = self.block_size
        blocks = self.full_groups * ceil_div(length, bs)
        if self.sliding_groups and self.window:
            in_flight = batched_tokens * ((pp + 1) if self.version.at_least(33) else 1)
            per = ceil_div(min(self.window - 1 + in_flight, length), bs) + 1
            blocks += self.sliding_groups * per
        return blocks

    def bytes_for(self, length: int, seqs: int, batched_tokens: int, pp: int = 1) -> int:
        """KV bytes that hold `seqs` requests of `length` tokens, block-rounded, plus the null block."""
        blocks = seqs * self.blocks_per_request(length, batched_tokens, pp) + 1
        return blocks * self.block_bytes

    def num_blocks(self, kv_bytes: int) -> int:
        return max(kv_bytes // self.block_bytes, 0) if self.block_bytes else 0

    def tokens(self, kv_bytes: int, length: int, batched_tokens: int, pp: int = 1) -> tuple[int, float]:
        """(KV cache tokens, max concurrency) vLLM logs for `kv_bytes` of KV memory."""
        blocks = self.num_blocks(kv_bytes)
        if not blocks or not self.groups:
            return 0, 0.0
        per_req = self.blocks_per_request(length, batched_tokens, pp)
        usable = blocks - (1 if self.version.null_block_reserved else 0)
        concurrency = usable / per_req if per_req else 0.0
        if self.version.tokens_from_concurrency or self.sliding_groups:
            return int(concurrency * length), concurrency
        return blocks // self.groups * self.block_size, concurrency

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


def kv_layout(model: ModelArch, s: Settings, version: VllmVersion) -> KvLayout:
    """Page sizes and groups (vllm-memory-accounting §5-6), for the fullest PP stage."""
    bs = s.block_size
    per_layer = kv_bytes_per_token_layer(model, s) * bs
    types = [t for t in model.layer_types if t]
    stage = ceil_div(len(types), s.pp)
    n_full = math.ceil(sum(1 for t in types if t == "full") / s.pp)
    n_slide = math.ceil(sum(1 for t in types if t == "sliding") / s.pp)
    if model.pooling and not model.layer_types:
        return KvLayout(bs, 0, 0, 0, None, version, pooling=True)
    if n_slide == 0 or n_full == 0:
        # one group holding every layer of the stage
        kind_sliding = n_full == 0 and n_slide > 0
        return KvLayout(bs, stage * per_layer, 0 if kind_sliding else 1, 1 if kind_sliding else 0,
                        model.sliding_window, version, pooling=model.pooling)
    # hybrid: group size g = the smallest bucket (or the largest if max < ratio x min)
    small, large = min(n_full, n_slide), max(n_full, n_slide)
    g = large if large < version.hybrid_group_ratio * small else small
    return KvLayout(bs, g * per_layer, ceil_div(n_full, g), ceil_div(n_slide, g), model.sliding_window, version,
                    pooling=model.pooling)


def adr_kv_bytes_per_token(model: ModelArch, s: Settings) -> int:
    """ADR-0002: 2 x layers x kvHeads x headDim x bytesPerKvElem / tp x (1 + kvOverheadPct),
    with headDim = hiddenSize / heads."""
    head_dim = model.hidden_size // model.num_attention_heads
    d = 1 if s.kv_cache_dtype.startswith("fp8") else 2
    raw = 2 * model.num_layers * model.num_kv_heads * head_dim * d / s.tp
    return int(raw * (1 + defaults.KV_OVERHEAD))
