"""Pictures of plans and estimates: rich for the terminal, inline SVG for HTML reports.

Every bar is one GPU, left to right: per deployment its weights, KV cache and activation +
overhead, then foreign use, free budget and the reserve (capacity - budget). Bytes come in as
integers; GiB appear only here.
"""

from __future__ import annotations

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
PALETTE = (  # (rich colour, hex) per deployment, assigned in name order
    ("dodger_blue2", "#1c86ee"),
    ("dark_orange", "#ff8c00"),
    ("green3", "#00cd00"),
    ("magenta", "#cd00cd"),
    ("gold1", "#ffd700"),
    ("cyan3", "#00cdcd"),
    ("deep_pink2", "#ff1493"),
    ("chartreuse3", "#66cd00"),
    ("medium_purple2", "#9f79ee"),
    ("salmon1", "#ff8c69"),
    ("steel_blue1", "#63b8ff"),
    ("khaki1", "#fff68f"),
    ("spring_green2", "#00ee76"),
    ("orchid", "#da70d6"),
    ("light_coral", "#f08080"),
    ("turquoise2", "#00e5ee"),
)
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
    """Deployment -> (rich colour, hex), in name order (deterministic)."""
    names = sorted(set(p.ledger.deployments()) | {k for k, d in p.decisions.items() if d.replicas})
    return {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(names)}


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


def node_title(p: Plan, node: str) -> str:
    counts: dict[str, int] = {}
    for s in p.ledger.nodes[node].gpus:
        counts[short(s.gpu.product)] = counts.get(short(s.gpu.product), 0) + 1
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
    if sizing.flags is not None:
        label = "flags: " if sizing.fits else "flags (if it fit): "
        console.print(Text(label, style="bold") + Text(" ".join(sizing.flags.args())))
    if sizing.kv_cache_tokens and sizing.fits:
        console.print(
            f"KV cache: {sizing.kv_cache_tokens} tokens, max concurrency {sizing.max_concurrency:.2f} "
            f"({sizing.kv_bytes_per_token} bytes per token)",
            highlight=False,
        )
    hybrid = hybrid_text(est)
    if hybrid and sizing.fits:
        console.print(hybrid, highlight=False)
    fp = sizing.footprint
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


SVG_LABEL = 260  # label column: "GPU 2 MIG 0 " and 24 characters of the product


def gpu_row_svg(p: Plan, sl: GpuSlot, palette: dict[str, tuple[str, str]], y: int, indent: int = 0) -> str:
    """One GPU as SVG: its label, its bar, and used/budget and free GiB (HTML report and SVG image)."""
    used, head = p.ledger.used_bytes(sl.node, sl.index), p.ledger.headroom_bytes(sl.node, sl.index)
    return (
        f'<text x="{indent}" y="{y + 13}" font-size="12">{html.escape(sl.label)} '
        f"{html.escape(sl.gpu.product[:24])}</text>"
        + svg_bar(gpu_segments(p, sl, palette), SVG_LABEL, y)
        + f'<text x="{SVG_LABEL + SVG_BAR + 8}" y="{y + 13}" font-size="12">'
        f"{gib(used)}/{gib(sl.budget_bytes)} GiB, {gib(head)} free</text>"
    )


def node_svg(p: Plan, node: str, palette: dict[str, tuple[str, str]]) -> str:
    slots = sorted(p.ledger.nodes[node].gpus, key=lambda s: s.index)
    height = ROW * max(len(slots), 1) + 6
    rows = [gpu_row_svg(p, sl, palette, 3 + i * ROW) for i, sl in enumerate(slots)]
    width = SVG_LABEL + SVG_BAR + 200
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif">{"".join(rows)}</svg>'
    )


def legend_html(palette: dict[str, tuple[str, str]]) -> str:
    items = [
        f'<span class="sw" style="background:{c};opacity:{o}"></span>{html.escape(lbl)}'
        for c, o, lbl in [("#555555", op, label) for _, label, _, op in COMPONENTS]
    ]
    items += [
        f'<span class="sw" style="background:{c}"></span>{lbl}'
        for c, lbl in ((FOREIGN[1], "foreign"), (FREE[1], "free"), (RESERVE[1], "reserve"))
    ]
    deps = [
        f'<span class="sw" style="background:{c}"></span>{html.escape(n)}' for n, (_, c) in palette.items()
    ]
    return f'<p class="legend">{" ".join(items)}</p><p class="legend">{" ".join(deps)}</p>'


def plan_html(p: Plan, title: str = "vllmfit plan") -> str:
    """One self-contained HTML file: inline CSS and SVG, no scripts, no external assets."""
    palette = colors(p)
    parts = [
        f"<h1>{html.escape(title)}</h1>",
        f"<p>{html.escape(summary_line(p).plain)}</p>",
        legend_html(palette),
    ]
    for node in sorted(p.ledger.nodes):
        parts.append(f"<h2>{html.escape(node)}</h2>{node_svg(p, node, palette)}")
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


def plan_svg(p: Plan) -> str:
    """One standalone SVG image: every GPU of every node as a bar, nodes in name order."""
    palette = colors(p)
    row, out, y = ROW, [], 4
    for node in sorted(p.ledger.nodes):
        out.append(f'<text x="0" y="{y + 14}" font-size="14" font-weight="bold">{html.escape(node)}</text>')
        y += row
        for sl in sorted(p.ledger.nodes[node].gpus, key=lambda s: s.index):
            out.append(gpu_row_svg(p, sl, palette, y, indent=10))
            y += row
    for i, (name, (_, color)) in enumerate(palette.items()):
        out.append(
            f'<rect x="0" y="{y + 4}" width="12" height="12" fill="{color}"/>'
            f'<text x="18" y="{y + 14}" font-size="12">{html.escape(name)}</text>'
        )
        y += row if i < len(palette) - 1 else 0
    width, height = SVG_LABEL + SVG_BAR + 200, y + row
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} '
        f'{height}" font-family="sans-serif">{"".join(out)}</svg>\n'
    )
