"""The layout of every picture, free of any format: what each bar is (its segments: owner, bytes,
colour, label), the deployments' palette, the summary, node titles and refusal lines.

The terminal (`terminal`), SVG (`svg`) and HTML (`html`) renderers draw these and decide nothing,
so they cannot disagree. Bytes come in as integers; GiB appear only at the display edge (`gib`).
Every GPU bar is one GPU, left to right: per deployment its weights, KV cache and activation +
overhead, then foreign use, free budget and the reserve (capacity - budget).
"""

from __future__ import annotations

import colorsys
from collections.abc import Sequence
from dataclasses import dataclass

from vllmfit.core import memory
from vllmfit.core.defaults import GIB
from vllmfit.core.memory import Estimate
from vllmfit.core.placement import Decision, GpuSlot, Plan, where

BAR_WIDTH = 48
GOLDEN_ANGLE = 137.50776405003785
"""360 x (1 - 1/phi) degrees: successive multiples never repeat and stay far apart (the namespaces' hues)."""
PHI = 1.618033988749895
FAMILY_SPREAD = 36.0
"""Degrees a namespace's deployments spread around its hue (+- half)."""
LIGHTNESS = (0.42, 0.60, 0.30, 0.72)
"""Lightness steps a namespace's deployments cycle through, so neighbours in a family differ twice."""
COMPONENTS = (  # (key, label, terminal character, SVG opacity)
    ("weights", "weights", "█", 1.0),
    ("kv_cache", "KV cache", "▓", 0.7),
    ("runtime", "activation + overhead", "▒", 0.4),
)
FOREIGN = ("grey50", "#7f7f7f", "█")
FREE = ("grey35", "#e8f5e9", "·")
RESERVE = ("red3", "#f4cccc", "░")


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


@dataclass(frozen=True)
class Segment:
    label: str  # what the tooltip / legend says
    bytes: int
    style: str  # rich colour
    color: str  # hex
    char: str
    opacity: float = 1.0


# --- Segments: the one place that decides what a bar shows ---------------------------------------


def colors(p: Plan) -> dict[str, tuple[str, str]]:
    """Deployment -> (rich colour, hex), in name order (deterministic); see `family_colors`."""
    names = sorted(set(p.ledger.deployments()) | {k for k, d in p.decisions.items() if d.replicas})
    return {n: (c, c) for n, c in family_colors(names).items()}


def family_colors(keys: Sequence[str]) -> dict[str, str]:
    """"namespace/name" -> "#rrggbb", distinct for any count, one hue family per namespace.

    Namespace i (in name order) gets the hue i x the golden angle: hues of successive namespaces
    land far apart and never repeat. Its j-th deployment gets that hue shifted by
    FAMILY_SPREAD x (frac(j x phi) - 1/2), again never repeating, at a lightness cycling through
    LIGHTNESS. rich prints "#rrggbb" in truecolor or the nearest colour the terminal has."""
    by_ns: dict[str, list[str]] = {}
    for key in sorted(keys):
        by_ns.setdefault(key.split("/", 1)[0] if "/" in key else "", []).append(key)
    out = {}
    for i, ns in enumerate(sorted(by_ns)):
        base = (i * GOLDEN_ANGLE) % 360.0
        for j, key in enumerate(by_ns[ns]):
            hue = (base + FAMILY_SPREAD * ((j * PHI) % 1.0 - 0.5)) % 360.0
            r, g, b = colorsys.hls_to_rgb(hue / 360.0, LIGHTNESS[j % len(LIGHTNESS)], 0.75)
            out[key] = f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"
    return out


def gpu_segments(p: Plan, sl: GpuSlot, palette: dict[str, tuple[str, str]]) -> list[Segment]:
    segs = []
    for b in p.ledger.bookings_on(sl.node, sl.index):
        style, color = palette.get(b.deployment, ("white", "#cccccc"))
        fp = b.footprint
        name = b.deployment + (f" #{b.replica}" if b.replica else "")
        for (_, label, char, opacity), val in zip(
            COMPONENTS, (fp.weights, fp.kv_cache, fp.activation + fp.overhead)
        ):
            segs.append(Segment(f"{name} {label}", val, style, color, char, opacity))
    used = p.ledger.used_bytes(sl.node, sl.index)
    segs.append(Segment("foreign use", sl.foreign_bytes, FOREIGN[0], FOREIGN[1], FOREIGN[2]))
    segs.append(Segment("free", max(sl.budget_bytes - used, 0), FREE[0], FREE[1], FREE[2]))
    segs.append(
        Segment("reserve", sl.capacity_bytes - max(sl.budget_bytes, used), RESERVE[0], RESERVE[1], RESERVE[2])
    )
    return [s for s in segs if s.bytes > 0]


def estimate_segments(est: Estimate) -> list[Segment]:
    fp = est.sizing.footprint
    free = max(est.budget_bytes - fp.total, 0)
    reserve = est.capacity_bytes - max(est.budget_bytes, fp.total)
    rows = (
        ("weights", fp.weights, "dodger_blue2", "#1c86ee", "█"),
        ("KV cache", fp.kv_cache, "green3", "#00cd00", "▓"),
        ("activation", fp.activation, "dark_orange", "#ff8c00", "▒"),
        ("overhead", fp.overhead, "magenta", "#cd00cd", "▒"),
        ("free", free, *FREE),
        ("reserve", reserve, *RESERVE),
    )
    return [Segment(label, max(val, 0), style, color, char) for label, val, style, color, char in rows]


def cells(values: Sequence[int], width: int) -> list[int]:
    """Split `width` characters in proportion to values (largest remainder: they add up exactly)."""
    total = sum(values)
    if total <= 0:
        return [0 for _ in values]
    raw = [v * width / total for v in values]
    out = [int(r) for r in raw]
    order = sorted(range(len(values)), key=lambda i: (-(raw[i] - out[i]), i))
    for i in order[: width - sum(out)]:
        out[i] += 1
    return out



def short(product: str) -> str:
    """'NVIDIA-L40S' -> 'L40S'; a MIG slice -> its profile ('3g.40gb')."""
    return product.split("-MIG-")[-1] if "-MIG-" in product else product.removeprefix("NVIDIA-")


def gpu_row_label(p: Plan, sl: GpuSlot) -> str:
    mixed = len({s.gpu.product for s in p.ledger.nodes[sl.node].gpus}) > 1
    return sl.label + (f" {short(sl.gpu.product)}" if mixed else "")


def node_title(p: Plan, node: str, full: bool = False) -> str:
    counts: dict[str, int] = {}
    for s in p.ledger.nodes[node].gpus:
        name = s.gpu.product if full else short(s.gpu.product)
        counts[name] = counts.get(name, 0) + 1
    return f"{node}: " + (", ".join(f"{n}x {prod}" for prod, n in sorted(counts.items())) or "no GPUs")



def placement_text(d: Decision) -> str:
    return "; ".join(where(r.node, r.gpus) for r in d.replicas) or "-"



@dataclass(frozen=True)
class Summary:
    """The cluster in numbers, for picture titles."""

    nodes: int
    gpus: int
    gpus_in_use: int
    budget_bytes: int
    used_bytes: int
    free_bytes: int
    admitted: int
    refused: int  # Unschedulable or Rejected
    pending: int

    def text(self) -> str:
        return (
            f"{self.nodes} nodes, {self.gpus} GPUs ({self.gpus_in_use} in use): used {gib(self.used_bytes)} GiB, "
            f"free {gib(self.free_bytes)} GiB of {gib(self.budget_bytes)} GiB budget; "
            f"{self.admitted} admitted, {self.refused} refused" + (f", {self.pending} pending" if self.pending else "")
        )


def summary(p: Plan) -> Summary:
    slots = p.ledger.slots()
    phases = [d.phase for d in p.decisions.values()]
    return Summary(
        nodes=len(p.ledger.nodes),
        gpus=len(slots),
        gpus_in_use=sum(1 for sl in slots if p.ledger.bookings_on(sl.node, sl.index)),
        budget_bytes=sum(sl.budget_bytes for sl in slots),
        used_bytes=sum(min(p.ledger.used_bytes(sl.node, sl.index), sl.budget_bytes) for sl in slots),
        free_bytes=sum(max(p.ledger.headroom_bytes(sl.node, sl.index), 0) for sl in slots),
        admitted=sum(1 for ph in phases if ph in ("Admitted", "Running")),
        refused=sum(1 for ph in phases if ph in ("Unschedulable", "Rejected", "Failed")),
        pending=sum(1 for ph in phases if ph == "Pending"),
    )


def refused(p: Plan) -> list[tuple[str, Decision]]:
    """The deployments not admitted, in name order."""
    return [(k, d) for k, d in sorted(p.decisions.items()) if d.phase in ("Unschedulable", "Rejected", "Failed")]


NODES_AVAILABLE = "nodes are available"


def refusal_lines(d: Decision) -> list[str]:
    """What a refused deployment is told: the headline and its grouped reasons, then the fixes."""
    at = d.message.find(NODES_AVAILABLE)
    head = d.message[: at + len(NODES_AVAILABLE)] if d.reasons and at >= 0 else ""
    lines = [f"{d.phase}: {head}" if head else f"{d.phase}: {d.reasons[0] if d.reasons else d.message}"]
    rest = d.reasons if head else d.reasons[1:]
    lines += [f"  {r}" for r in rest]
    lines += [f"  fits with: {s}" for s in d.suggestions]
    return lines



SPEC_FLAGS = {
    "tensorParallelSize": "--tp",
    "pipelineParallelSize": "--pp",
    "dtype": "--dtype",
    "quantization": "--quantization",
    "kvCacheDtype": "--kv-cache-dtype",
    "maxModelLen": "--max-model-len",
    "maxNumSeqs": "--max-num-seqs",
    "maxNumBatchedTokens": "--max-num-batched-tokens",
    "gpuMemoryUtilization": "--gpu-memory-utilization",
    "cpuOffload": "--cpu-offload",
}
"""Spec field -> `vllmfit estimate` flag: a fix ("maxModelLen: 8192, kvCacheDtype: fp8", the spec's
vocabulary, as the operator and `--output json` give it) printed in the CLI's own words."""


def as_flags(fix: str) -> str:
    """'tensorParallelSize: 8, quantization: fp8' -> '--tp 8 --quantization fp8' (unknown keys kept)."""
    parts = []
    for part in fix.split(", "):
        key, sep, value = part.partition(": ")
        parts.append(f"{SPEC_FLAGS[key]} {value}" if sep and key in SPEC_FLAGS else part)
    return " ".join(parts)


def hybrid_text(est: Estimate) -> str:
    """One line on a hybrid model's recurrent state, as vLLM lays it out."""
    m = est.model
    if not m.is_hybrid_state or est.settings.policy != "vllm":
        return ""
    lay = memory.kv_layout(m, est.settings, est.version)
    assert m.state is not None
    return (f"recurrent state ({m.state.kind}, {m.num_state_layers} of {m.num_layers} layers): "
            f"{lay.state_bytes_per_request / 2**20:.1f} MiB per request in {lay.state_groups} state groups "
            f"x {lay.state_blocks} blocks; attention block size {lay.block_size} tokens "
            f"(grown to hold a {lay.state_page_bytes} B state page)")

