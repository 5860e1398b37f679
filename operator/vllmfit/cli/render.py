"""Pictures of plans and estimates: rich for the terminal, inline SVG for HTML reports.

Every bar is one GPU, left to right: per deployment its weights, KV cache and activation +
overhead, then foreign use, free budget and the reserve (capacity - budget). Bytes come in as
integers; GiB appear only here.
"""

from __future__ import annotations

import colorsys
import html
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from rich.text import Text

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
PHASE_STYLE = {
    "Admitted": "green",
    "Running": "green",
    "Unschedulable": "yellow",
    "Rejected": "red",
    "Pending": "blue",
    "Failed": "red",
}


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


def bar(segments: Sequence[Segment], width: int = BAR_WIDTH) -> Text:
    text = Text()
    for seg, n in zip(segments, cells([s.bytes for s in segments], width)):
        text.append(seg.char * n, style=seg.style)
    return text


# --- Terminal: plan --------------------------------------------------------------------------------


def print_plan(console: Console, p: Plan, width: int | None = None) -> None:
    palette = colors(p)
    wide = console.width >= 120
    label_width = max((len(gpu_row_label(p, s)) for s in p.ledger.slots()), default=5)
    room = console.width - label_width - 30 - (28 if wide else 0)  # used/free text, deployments
    bar_width = width or max(16, min(60, room))
    console.print(summary_line(p))
    console.print(legend(palette))
    for node in sorted(p.ledger.nodes):
        console.print(node_table(p, node, palette, bar_width, wide, label_width))
    if p.decisions:
        console.print(Text("\nDeployments", style="bold"))
    for key in sorted(p.decisions):
        print_deployment(console, p, key, palette)
    for line in p.warnings:
        console.print(Text(f"warning: {line}", style="yellow"))
    for line in p.errors:
        console.print(Text(f"error: {line}", style="red"))


def summary_line(p: Plan) -> Text:
    phases = [d.phase for d in p.decisions.values()]
    gpus = p.ledger.slots()
    used = sum(1 for s in gpus if p.ledger.bookings_on(s.node, s.index))
    t = Text(
        f"{len(p.ledger.nodes)} nodes, {len(gpus)} GPUs ({used} in use), {len(phases)} deployments: ",
        style="bold",
    )
    parts = [(ph, phases.count(ph)) for ph in sorted(set(phases), key=lambda x: (x != "Admitted", x))]
    for i, (ph, n) in enumerate(parts):
        t.append(f"{n} {ph.lower()}" + (", " if i < len(parts) - 1 else ""), style=PHASE_STYLE.get(ph, ""))
    if p.errors:
        t.append(f"; {len(p.errors)} input errors", style="red")
    return t


def legend(palette: dict[str, tuple[str, str]]) -> Text:
    t = Text()
    for _, label, char, _ in COMPONENTS:
        t.append(f"{char * 2} {label}  ")
    for (style, _, char), label in ((FOREIGN, "foreign"), (FREE, "free"), (RESERVE, "reserve")):
        t.append(char * 2, style=style)
        t.append(f" {label}  ")
    if palette:
        t.append("\n")
    for name, (style, _) in palette.items():
        t.append("■ ", style=style)
        t.append(f"{name}  ")
    return t


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


def node_table(
    p: Plan, node: str, palette: dict[str, tuple[str, str]], width: int, wide: bool, label_width: int = 5
) -> Table:
    info = p.ledger.nodes[node]
    table = Table(
        title=node_title(p, node),
        title_justify="left",
        title_style="bold",
        box=None,
        pad_edge=False,
        show_header=False,
    )
    table.add_column("GPU", no_wrap=True, min_width=label_width)
    table.add_column("bar", no_wrap=True)
    table.add_column("used", justify="right", no_wrap=True)
    if wide:
        table.add_column("deployments")
    for sl in sorted(info.gpus, key=lambda s: s.index):
        head = p.ledger.headroom_bytes(sl.node, sl.index)
        label = gpu_row_label(p, sl)
        used = Text(f"{gib(p.ledger.used_bytes(sl.node, sl.index))}/{gib(sl.budget_bytes)} GiB, ")
        used.append(f"{gib(head)} free", style="red" if head < 0 else "")
        row: list[Text | str] = [label, bar(gpu_segments(p, sl, palette), width), used]
        if wide:
            deps = sorted({b.deployment for b in p.ledger.bookings_on(sl.node, sl.index)})
            row.append(Text(", ").join([Text(d, style=palette.get(d, ("", ""))[0]) for d in deps]))
        table.add_row(*row)
    return table


def placement_text(d: Decision) -> str:
    return "; ".join(where(r.node, r.gpus) for r in d.replicas) or "-"


def print_deployment(console: Console, p: Plan, key: str, palette: dict[str, tuple[str, str]]) -> None:
    """Two to four lines: phase, name, model; where and how much; flags; then why not and fixes."""
    d = p.decisions[key]
    req = p.requests.get(key)
    head = Text(f"{d.phase:<13} ", style=PHASE_STYLE.get(d.phase, ""))
    head.append("■ ", style=palette.get(key, ("", ""))[0])
    head.append(key, style="bold")
    if req is not None:
        head.append(f"  {req.model.name}")
    if d.restored:
        head.append("  (kept: from status)", style="dim")
    console.print(head)
    if d.replicas:
        sizing = d.replicas[0].sizing
        fp = sizing.footprint
        line = f"  on {placement_text(d)}: {gib(fp.total)} GiB per GPU, KV cache {gib(fp.kv_cache)} GiB"
        if sizing.kv_cache_tokens:
            line += f" = {sizing.kv_cache_tokens} tokens (max concurrency {sizing.max_concurrency:.1f})"
        console.print(line, highlight=False)
    if d.flags is not None and d.admitted:
        console.print(Text("  " + " ".join(d.flags.args()), style="cyan"))
    if not d.admitted:
        at = d.message.find(NODES_AVAILABLE)
        if d.reasons and at >= 0:  # the kube-scheduler's headline, then its groups
            console.print(f"  {d.message[: at + len(NODES_AVAILABLE)]}:", highlight=False)
        for r in d.reasons:
            console.print(f"  - {r}", highlight=False)
        if not d.reasons and d.message:
            console.print(f"  {d.message}", highlight=False)
        if d.suggestions:
            console.print("  fits with (each checked):", highlight=False)
            for s in d.suggestions:
                console.print(Text(f"    {s}", style="green"))
    for w in d.warnings:
        console.print(Text(f"  warning: {w}", style="yellow"))


# --- Terminal: estimate (one deployment, one GPU) ------------------------------------------------


def print_estimate(console: Console, est: Estimate, width: int = BAR_WIDTH) -> None:
    s = est.settings
    sizing = est.sizing
    gpus = f"{s.gpus}x" + (f" (tp={s.tp}, pp={s.pp})" if s.gpus > 1 else "")
    console.print(
        Text(
            f"{est.model.name} on {gpus} {est.gpu.name} ({gib(est.capacity_bytes)} GiB), "
            f"vLLM {est.version.label}, policy {s.policy}",
            style="bold",
        )
    )
    segments = estimate_segments(est)
    scale = Text(f"  {gib(sizing.footprint.total)} of {gib(est.capacity_bytes)} GiB")
    if sizing.footprint.total > est.capacity_bytes:
        scale = Text(
            f"  {gib(sizing.footprint.total)} GiB: {sizing.footprint.total / est.capacity_bytes:.1f}x "
            "the GPU's memory",
            style="red",
        )
    console.print(bar(segments, width) + scale)
    console.print(
        Text("  ").join([Text(seg.char * 2 + " ", style=seg.style) + Text(seg.label) for seg in segments])
    )
    console.print(estimate_table(est))
    fp = sizing.footprint
    if s.lora_max_loras is not None or fp.cpu_offloaded:
        parts = [f"{gib(fp.lora)} GiB of LoRA slots ({s.lora_max_loras} x rank {s.lora_max_rank})"] \
            if s.lora_max_loras is not None else []
        if fp.cpu_offloaded:
            parts.append(f"{gib(fp.cpu_offloaded)} GiB offloaded to CPU memory")
        console.print(f"weights include {' and exclude '.join(parts)}", highlight=False)
    if sizing.flags is not None:
        label = "flags: " if sizing.fits else "flags (if it fit): "
        console.print(Text(label, style="bold") + Text(" ".join(sizing.flags.args())))
    if sizing.kv_cache_tokens and sizing.fits:
        console.print(
            f"KV cache: {sizing.kv_cache_tokens} tokens, max concurrency {sizing.max_concurrency:.2f} "
            f"({sizing.kv_bytes_per_token} bytes per token)"
            + (f"; {sizing.concurrency_typical:.1f} requests of the typical {sizing.typical_len} tokens"
               if sizing.concurrency_typical is not None else ""),
            highlight=False,
        )
    hybrid = hybrid_text(est)
    if hybrid and sizing.fits:
        console.print(hybrid, highlight=False)
    if sizing.fits and est.settings.policy == "vllm" and fp.margin:
        low, high = fp.kv_range
        console.print(
            f"KV cache vLLM will find: {gib(low)} to {gib(high)} GiB (margin {fp.margin / 2**30:.2f} GiB, "
            "measured for this architecture class, booked in overhead)",
            highlight=False,
        )
    if est.vllm is not None and sizing.fits:
        console.print(vllm_table(est))
    if sizing.fits:
        console.print(Text(f"fits: {gib(est.headroom_bytes)} GiB of budget left per GPU", style="bold green"))
    else:
        console.print(Text("does not fit", style="bold red"))
    for r in sizing.reasons:
        console.print(f"  - {r}", highlight=False)
    if est.suggestions:
        console.print("fits with (each checked):")
        for sug in est.suggestions:
            console.print(Text(f"  {as_flags(sug)}", style="green"))
    for w in est.warnings:
        console.print(Text(f"warning: {w}", style="yellow"))


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


def estimate_table(est: Estimate) -> Table:
    fp = est.sizing.footprint
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("per GPU")
    table.add_column("GiB", justify="right")
    table.add_column("of capacity", justify="right")
    rows = [
        ("weights", fp.weights),
        ("KV cache", fp.kv_cache),
        ("activation", fp.activation),
        ("overhead", fp.overhead),
        ("= footprint", fp.total),
        ("budget", est.budget_bytes),
        (
            "free (budget - footprint)" if fp.total <= est.budget_bytes else "over budget by",
            abs(est.budget_bytes - fp.total),
        ),
        ("reserve (capacity - budget)", est.capacity_bytes - est.budget_bytes),
        ("capacity", est.capacity_bytes),
    ]
    for label, val in rows:
        table.add_row(label, gib(val), f"{100 * val / est.capacity_bytes:.1f}%" if est.capacity_bytes else "")
    return table


def vllm_table(est: Estimate) -> Table:
    v = est.vllm
    assert v is not None
    table = Table(
        title="vLLM start-up (predicted log)", title_justify="left", show_edge=False, pad_edge=False
    )
    table.add_column("")
    table.add_column("value", justify="right")
    for label, val in (
        ("requested memory ceil(T x u)", f"{gib(v.requested_bytes)} GiB"),
        ("model weights", f"{gib(v.weights_bytes)} GiB"),
        ("activation peak", f"{gib(v.activation_peak_bytes)} GiB"),
        ("non-torch memory", f"{gib(v.non_torch_bytes)} GiB"),
        ("CUDA graphs", f"{gib(v.cuda_graph_bytes)} GiB"),
        ("available KV cache memory", f"{gib(v.kv_cache_bytes)} GiB"),
        ("GPU KV cache size", f"{v.kv_cache_tokens} tokens"),
        ("GPU blocks", str(v.num_gpu_blocks)),
        ("maximum concurrency", f"{v.max_concurrency:.2f}x"),
    ):
        table.add_row(label, val)
    return table


# --- SVG and HTML ----------------------------------------------------------------------------------

SVG_BAR = 520
ROW = 22
MARGIN = 10
CHAR_PX = 7.3
"""Advance of one character of the 12 px monospace font labels are set in (0.6 em), for widths."""
FONT = "font-family=\"DejaVu Sans, Arial, sans-serif\""
MONO = "font-family=\"DejaVu Sans Mono, Menlo, Consolas, monospace\""


def svg_bar(segments: Sequence[Segment], x: int, y: int, width: int = SVG_BAR, height: int = 16) -> str:
    total = sum(s.bytes for s in segments) or 1
    out, pos = [], 0.0
    for seg in segments:
        w = seg.bytes * width / total
        tip = html.escape(f"{seg.label}: {gib(seg.bytes)} GiB")
        out.append(
            f'<rect x="{x + pos:.1f}" y="{y}" width="{w:.1f}" height="{height}" fill="{seg.color}" '
            f'fill-opacity="{seg.opacity}" stroke="#ffffff" stroke-width="0.5"><title>{tip}</title></rect>'
        )
        pos += w
    out.append(f'<rect x="{x}" y="{y}" width="{width}" height="{height}" fill="none" stroke="#555555"/>')
    return "".join(out)


def gpu_label_text(sl: GpuSlot) -> str:
    """'GPU 1 MIG 0 NVIDIA-A100-SXM4-80GB-MIG-3g.40gb': the slot and its whole product name."""
    return f"{sl.label} {sl.gpu.product}"


def text_px(text: str) -> int:
    return int(len(text) * CHAR_PX) + 1


def label_px(p: Plan, indent: int = 0) -> int:
    """Width of the label column: the longest GPU label, whole."""
    return max((text_px(gpu_label_text(sl)) for sl in p.ledger.slots()), default=80) + indent + 12


def gpu_row_svg(p: Plan, sl: GpuSlot, palette: dict[str, tuple[str, str]], y: int, indent: int = 0,
                label_w: int | None = None) -> str:
    """One GPU as SVG: its whole label, its bar, and used/budget and free GiB."""
    used, head = p.ledger.used_bytes(sl.node, sl.index), p.ledger.headroom_bytes(sl.node, sl.index)
    x = label_w if label_w is not None else label_px(p, indent)
    return (
        f'<text x="{indent}" y="{y + 13}" font-size="12" {MONO}>{html.escape(gpu_label_text(sl))}</text>'
        + svg_bar(gpu_segments(p, sl, palette), x, y)
        + f'<text x="{x + SVG_BAR + 8}" y="{y + 13}" font-size="12" {FONT}>'
        f"{gib(used)}/{gib(sl.budget_bytes)} GiB, {gib(head)} free</text>"
    )


def node_svg(p: Plan, node: str, palette: dict[str, tuple[str, str]]) -> str:
    slots = sorted(p.ledger.nodes[node].gpus, key=lambda s: s.index)
    height = ROW * max(len(slots), 1) + 6
    label_w = label_px(p)
    rows = [gpu_row_svg(p, sl, palette, 3 + i * ROW, label_w=label_w) for i, sl in enumerate(slots)]
    width = label_w + SVG_BAR + 200
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" {FONT}>{"".join(rows)}</svg>'
    )


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


def legend_html(palette: dict[str, tuple[str, str]]) -> str:
    items = [
        f'<span class="item"><span class="sw" style="background:{c};opacity:{o}"></span>{html.escape(lbl)}</span>'
        for c, o, lbl in [("#555555", op, label) for _, label, _, op in COMPONENTS]
    ]
    items += [
        f'<span class="item"><span class="sw" style="background:{c}"></span>{lbl}</span>'
        for c, lbl in ((FOREIGN[1], "foreign use"), (FREE[1], "free"), (RESERVE[1], "reserve"))
    ]
    deps = [
        f'<span class="item"><span class="sw" style="background:{c}"></span>{html.escape(n)}</span>'
        for n, (_, c) in palette.items()
    ]
    return (f'<p class="legend" title="legend">{" ".join(items)}</p>'
            f'<p class="legend" title="deployments">{" ".join(deps)}</p>')


def plan_html(p: Plan, title: str = "vllmfit plan") -> str:
    """One self-contained HTML file: inline CSS and SVG, no scripts, no external assets."""
    palette = colors(p)
    parts = [
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="summary">{html.escape(summary(p).text())}</p>',
        legend_html(palette),
    ]
    gone = refused(p)
    if gone:
        parts.append('<h2>Refused</h2><ul class="refused">' + "".join(
            f'<li><b>{html.escape(k)}</b><ul>' + "".join(f"<li>{html.escape(x.strip())}</li>" for x in refusal_lines(d))
            + "</ul></li>" for k, d in gone) + "</ul>")
    for node in sorted(p.ledger.nodes):
        parts.append(f"<h2>{html.escape(node_title(p, node, full=True))}</h2>{node_svg(p, node, palette)}")
    parts.append(
        "<h2>Deployments</h2><table><tr><th>deployment</th><th>model</th><th>phase</th><th>placement</th>"
        "<th>flags</th><th>per GPU (GiB)</th><th>KV cache</th><th>notes</th></tr>"
    )
    for key in sorted(p.decisions):
        parts.append(deployment_row_html(p, key, palette))
    parts.append("</table>")
    for title_, lines, cls in (("Warnings", p.warnings, "warn"), ("Input errors", p.errors, "err")):
        if lines:
            parts.append(
                f"<h2>{title_}</h2><ul>"
                + "".join(f'<li class="{cls}">{html.escape(x)}</li>' for x in lines)
                + "</ul>"
            )
    css = (
        "body{font-family:sans-serif;margin:2em;color:#222}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;text-align:left}"
        ".sw{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;border:1px solid #555}"
        ".item{white-space:nowrap}"
        ".Admitted{color:#1b5e20}.Unschedulable{color:#b26a00}.Rejected{color:#b71c1c}"
        ".warn{color:#b26a00}.err{color:#b71c1c}.fix{color:#1b5e20}ul{margin:0;padding-left:1.2em}"
    )
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{css}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n"
    )


def deployment_row_html(p: Plan, key: str, palette: dict[str, tuple[str, str]]) -> str:
    d = p.decisions[key]
    req = p.requests.get(key)
    fp = d.replicas[0].sizing.footprint if d.replicas else None
    sizing = d.replicas[0].sizing if d.replicas else None
    kv = ""
    if fp is not None and sizing is not None:
        kv = f"{gib(fp.kv_cache)} GiB" + (
            f", {sizing.kv_cache_tokens} tokens" if sizing.kv_cache_tokens else ""
        )
    notes = [f"<li>{html.escape(r)}</li>" for r in d.reasons]
    notes += [f'<li class="fix">fits with: {html.escape(s)}</li>' for s in d.suggestions]
    notes += [f'<li class="warn">{html.escape(w)}</li>' for w in d.warnings]
    color = palette.get(key, ("", "#ffffff"))[1]
    cells_ = [
        f'<span class="sw" style="background:{color}"></span>{html.escape(key)}',
        html.escape(req.model.name if req else ""),
        f'<span class="{d.phase}">{d.phase}{" (kept)" if d.restored else ""}</span>',
        html.escape(placement_text(d)),
        html.escape(" ".join(d.flags.args()) if d.flags else ""),
        gib(fp.total) if fp else "",
        html.escape(kv),
        f"<ul>{''.join(notes)}</ul>" if notes else "",
    ]
    return "<tr>" + "".join(f"<td>{c}</td>" for c in cells_) + "</tr>"


def plan_svg(p: Plan, title: str = "vllmfit plan") -> str:
    """One standalone SVG image: a title with the cluster summary, a legend (components and a
    colour per deployment), every GPU of every node as a bar with its whole product name, and the
    refused deployments with their grouped reasons."""
    palette = colors(p)
    label_w = label_px(p, indent=10)
    out: list[str] = []
    texts: list[str] = []  # every line of text, for the image's width
    y = 4

    def line(text: str, size: int = 12, bold: bool = False, x: int = 0, mono: bool = False, cls: str = "") -> None:
        nonlocal y
        weight = ' font-weight="bold"' if bold else ""
        klass = f' class="{cls}"' if cls else ""
        out.append(f'<text x="{x}" y="{y + size + 2}" font-size="{size}"{weight}{klass} {MONO if mono else FONT}>'
                   f"{html.escape(text)}</text>")
        texts.append(" " * (x // 7) + text)
        y += size + 8

    line(title, 16, bold=True, cls="title")
    line(summary(p).text(), cls="summary")
    y += 4
    # legend: components, then one swatch per deployment, in columns
    x = 0
    items = [(label, "#555555", op) for _, label, _, op in COMPONENTS]
    items += [("foreign use", FOREIGN[1], 1.0), ("free", FREE[1], 1.0), ("reserve", RESERVE[1], 1.0)]
    out.append('<g class="legend">')
    for label, color, opacity in items:
        out.append(f'<rect x="{x}" y="{y}" width="12" height="12" fill="{color}" fill-opacity="{opacity}" '
                   f'stroke="#555555" stroke-width="0.5"/><text x="{x + 16}" y="{y + 11}" font-size="12" {FONT}>'
                   f"{html.escape(label)}</text>")
        x += 16 + text_px(label) + 14
    y += ROW
    names = list(palette)
    col_w = max((text_px(n) for n in names), default=0) + 30
    width = max(label_w + SVG_BAR + 200, x)
    per_row = max(1, width // max(col_w, 1))
    for k, name in enumerate(names):
        cx, cy = (k % per_row) * col_w, y + (k // per_row) * ROW
        out.append(f'<rect x="{cx}" y="{cy}" width="12" height="12" fill="{palette[name][1]}"/>'
                   f'<text x="{cx + 16}" y="{cy + 11}" font-size="12" {MONO}>{html.escape(name)}</text>')
    y += ROW * ((len(names) + per_row - 1) // per_row) + 8
    out.append("</g>")
    for node in sorted(p.ledger.nodes):
        line(node_title(p, node, full=True), 14, bold=True)
        for sl in sorted(p.ledger.nodes[node].gpus, key=lambda s: s.index):
            out.append(gpu_row_svg(p, sl, palette, y, indent=10, label_w=label_w))
            y += ROW
        y += 6
    gone = refused(p)
    if gone:
        out.append('<g class="refused">')
        line(f"Refused ({len(gone)})", 14, bold=True)
        for key, d in gone:
            line(key, 12, bold=True, mono=True)
            for text in refusal_lines(d):
                line(text, 12, x=10, mono=True)
        out.append("</g>")
    width = max([width] + [text_px(t) + 10 for t in texts]) + 2 * MARGIN
    height = y + 8 + 2 * MARGIN
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} '
        f'{height}" {FONT}><title>{html.escape(title + ": " + summary(p).text())}</title>'
        f'<rect width="100%" height="100%" fill="#ffffff"/><g transform="translate({MARGIN},{MARGIN})">'
        f'{"".join(out)}</g></svg>\n'
    )
