"""The vLLM versions vllmfit models, and the accounting rules that change between them
(vllm-memory-accounting.md section 11)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

# --- vLLM versions (vllm-memory-accounting.md §11) -----------------------------------------

MODELLED_VERSIONS = ((0, 11), (0, 15), (0, 17), (0, 19), (0, 21), (0, 33))
OLDEST_ACCEPTED = (0, 10)
"""Older images are refused (validation): V1 became the default engine in 0.8 but V0 stayed
selectable (and was chosen silently for unsupported features) until 0.10; vLLM's accounting
before that is not what vllmfit models. 0.10.x is sized with the 0.11 rules, with a warning."""


@dataclass(frozen=True)
class VllmVersion:
    """The version-dependent rules of vLLM's memory accounting."""

    major: int
    minor: int
    kv_cache_memory_bytes_flag: bool = True
    """--kv-cache-memory-bytes exists: first released in 0.10.2 (absent in 0.10.0-0.10.1.1;
    vllm-flags.md section 4). Every modelled version has it; an image older than 0.10.2 is
    modelled as the oldest version with this False."""

    @property
    def label(self) -> str:
        return f"{self.major}.{self.minor}"

    def at_least(self, minor: int) -> bool:
        return (self.major, self.minor) >= (0, minor)

    @property
    def default_utilization(self) -> float:
        return 0.92 if self.at_least(21) else 0.90

    @property
    def ceil_requested(self) -> bool:
        return self.at_least(15)

    @property
    def graphs_in_budget(self) -> bool:
        """From 0.21 the CUDA-graph estimate is subtracted from the KV budget (inside R)."""
        return self.at_least(21)

    @property
    def null_block_reserved(self) -> bool:
        """0.33's fit check plans against KV_avail - one block (the null block); the logged
        capacity still divides every block (vLLM oracle, tests/data/vllm-oracle)."""
        return self.at_least(33)

    @property
    def tokens_from_concurrency(self) -> bool:
        """From 0.21 the logged KV tokens are floor(X x L); before, blocks / groups x block size."""
        return self.at_least(21)

    @property
    def hybrid_group_ratio(self) -> float:
        return 1.5 if self.at_least(21) else (1.25 if self.at_least(15) else 1.0)

    @property
    def logits_bytes_per_element(self) -> float:
        """Activation peak per (sampler row x vocab entry). Calibrated: 38.9 B up to 0.16, 15.4 B
        from 0.17 (Qwen3-14B on H100: 5.64 -> 2.23 GiB; shared/calibration rows 47-51)."""
        return 15.4 if self.at_least(17) else 38.9


def requested_version(text: str | None) -> tuple[int, int] | None:
    """(major, minor) of a version or image tag, None when it names none ('latest', a digest)."""
    if not text:
        return None
    tag = text.rsplit(":", 1)[-1] if ":" in text else text
    parts = tag.lstrip("vV").split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return None


def parse_version(text: str | None) -> tuple[VllmVersion, str | None]:
    """'0.21', '0.21.1', 'v0.33.0', an image tag 'vllm/vllm-openai:v0.11.0' -> version, warning."""
    newest = VllmVersion(*MODELLED_VERSIONS[-1])
    if not text:
        return newest, None
    tag = text.rsplit(":", 1)[-1] if ":" in text else text
    tag = tag.lstrip("vV")
    parts = tag.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
        patch_digits = "".join(itertools.takewhile(str.isdigit, parts[2])) if len(parts) > 2 else ""
        patch = int(patch_digits or 0)
    except (ValueError, IndexError):
        return newest, f"vLLM version {text!r} is not a version number; using the newest modelled ({newest.label})"
    v = VllmVersion(major, minor)
    if (major, minor) > MODELLED_VERSIONS[-1]:
        return newest, f"vLLM {v.label} is newer than the newest modelled version; using {newest.label} rules"
    if (major, minor) < MODELLED_VERSIONS[0]:
        oldest = VllmVersion(*MODELLED_VERSIONS[0], kv_cache_memory_bytes_flag=(major, minor, patch) >= (0, 10, 2))
        return oldest, f"vLLM {v.label} is older than the oldest modelled version; using {oldest.label} rules"
    return v, None
