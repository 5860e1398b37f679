"""The terminal: rich tables and character bars of plans and estimates, drawn from `layout`. Lines
of vLLM flags and of fixes are printed whole (`soft_wrap`): the terminal folds them on screen, and
a copy of one is one command line, never a flag cut in two."""

from __future__ import annotations

from collections.abc import Sequence

from rich.columns import Columns
from rich.console import Console
from rich.table import Table
from rich.text import Text

from vllmfit.cli.render.layout import (
    BAR_WIDTH,
    COMPONENTS,
    FOREIGN,
    FREE,
    NODES_AVAILABLE,
    RESERVE,
    Look,
    Segment,
    as_flags,
    count,
    estimate_segments,
    gib,
    gpu_row_label,
    gpu_segments,
    hybrid_text,
    looks,
    node_title,
    placement_text,
    pod_lines,
    spans,
)
from vllmfit.core.memory import Estimate, Sizing
from vllmfit.core.placement import GpuSlot, Plan

PHASE_STYLE = {
    "Admitted": "green",
    "Running": "green",
    "Unschedulable": "yellow",
    "Rejected": "red",
    "Pending": "blue",
    "Failed": "red",
}


def letter_style(look: Look) -> str:
    return f"bold {look.ink} on {look.color}"


def bar(segments: Sequence[Segment], width: int = BAR_WIDTH, palette: dict[str, Look] | None = None) -> Text:
    """The segments as `width` characters; each deployment's run starts with the longest of its
    name, short name or letter that fits, so the bar says whose bytes these are without colour."""
    text = Text()
    it = iter(segments)
    for owner, n, per in spans(segments, width):
        run = [next(it) for _ in per]
        look = palette.get(owner) if palette and owner else None
        label = look.label_for(n) if look else ""
        if label and look:
            text.append(label, style=letter_style(look))
        skip = len(label)
        for seg, k in zip(run, per):
            cut = min(skip, k)
            skip -= cut
            text.append(seg.char * (k - cut), style=seg.style)
    return text


# --- Terminal: plan --------------------------------------------------------------------------------


def print_plan(console: Console, p: Plan, width: int | None = None) -> None:
    """The plan as text. On a terminal, tables that the terminal folds; anywhere else (a pipe, a
    file) plain lines laid out for the console's width that are never continued on the next line:
    a legend entry or a GPU row is one line, a flag list is printed whole however long it is.
    Input errors are not printed here: the command writes them on stderr."""
    palette = looks(p)
    label_width = max((len(gpu_row_label(p, s)) for s in p.ledger.slots()), default=5)
    console.print(summary_line(p))
    if console.is_terminal:
        wide = console.width >= 120
        room = console.width - label_width - 30 - (28 if wide else 0)  # used/free text, deployments
        bar_width = width or max(16, min(60, room))
        console.print(legend(palette))
        if palette:
            console.print(key_columns(palette))
        for node in sorted(p.ledger.nodes):
            console.print(node_table(p, node, palette, bar_width, wide, label_width))
    else:
        for line in plain_legend(palette, console.width):
            console.print(line, soft_wrap=True)
        marks = max((len(gpu_marks(p, sl, palette)) for sl in p.ledger.slots()), default=0)
        bar_width = width or max(16, min(60, console.width - label_width - 30 - marks))
        for node in sorted(p.ledger.nodes):
            for line in node_lines(p, node, palette, bar_width, label_width):
                console.print(line, soft_wrap=True)
    if p.decisions:
        console.print(Text("\nDeployments", style="bold"))
    for key in sorted(p.decisions):
        print_deployment(console, p, key, palette)
    for line in p.warnings:
        console.print(Text(f"warning: {line}", style="yellow"), soft_wrap=True)


def summary_line(p: Plan) -> Text:
    phases = [d.phase for d in p.decisions.values()]
    gpus = p.ledger.slots()
    used = sum(1 for s in gpus if p.ledger.bookings_on(s.node, s.index))
    t = Text(f"{count(len(p.ledger.nodes), 'node')}, {count(len(gpus), 'GPU')} ({used} in use), "
             f"{count(len(phases), 'deployment')}", style="bold")
    parts = [(ph, phases.count(ph)) for ph in sorted(set(phases), key=lambda x: (x != "Admitted", x))]
    for i, (ph, n) in enumerate(parts):
        t.append(": " if i == 0 else ", ")
        t.append(f"{n} {ph.lower()}", style=PHASE_STYLE.get(ph, ""))
    if p.errors:
        t.append(f"; {count(len(p.errors), 'input error')} (on stderr)", style="red")
    return t


def legend_groups(palette: dict[str, Look]) -> list[tuple[str, list[Text]]]:
    """What the characters mean: a deployment's own characters (drawn in each deployment's colour,
    so shown here uncoloured), then foreign use, free and reserve."""
    own = [Text(char * 2 + f" {label}") for _, label, char, _ in COMPONENTS]
    other = [Text.assemble((char * 2, style), f" {label}")
             for (style, _, char), label in ((FOREIGN, "foreign use"), (FREE, "budget left"),
                                             (RESERVE, "held back (capacity - budget)"))]
    return [("deployment: name or letter, ", own), ("else: ", other)]


def legend(palette: dict[str, Look]) -> Text:
    """What the characters mean, in two lines (the key of marks and names follows it)."""
    return Text("\n").join(Text(head) + Text("  ").join(items) for head, items in legend_groups(palette))


def plain_legend(palette: dict[str, Look], width: int) -> list[Text]:
    """The legend and the key as lines of at most `width` characters where the entries allow: a
    group on one line when it fits, else one entry per line; the key in columns when they fit,
    else one deployment per line. No entry is ever split."""
    out: list[Text] = []
    for head, items in legend_groups(palette):
        line = Text(head) + Text("  ").join(items)
        out += [line] if line.cell_len <= width else [Text(head.rstrip(", :") + ":"), *(Text("  ") + i for i in items)]
    entries = [key_item(look) for look in palette.values()]
    if not entries:
        return out
    col = max(e.cell_len for e in entries) + 3
    per_row = max(1, (width + 3) // col)
    for at in range(0, len(entries), per_row):
        row = entries[at:at + per_row]
        line = Text()
        for i, e in enumerate(row):
            line.append_text(e)
            if i < len(row) - 1:
                line.append(" " * (col - e.cell_len))
        out.append(line)
    return out


def gpu_marks(p: Plan, sl: GpuSlot, palette: dict[str, Look]) -> str:
    """The marks of the deployments on one GPU, in name order ('A L Q')."""
    deps = sorted({b.deployment for b in p.ledger.bookings_on(sl.node, sl.index)})
    return " ".join(palette[d].letter if d in palette else d for d in deps)


def node_lines(p: Plan, node: str, palette: dict[str, Look], width: int, label_width: int) -> list[Text]:
    """A node as plain lines: its title, then one line per GPU (label, bar, used and left, the
    marks of its deployments, whose names the key gives)."""
    out = [Text(node_title(p, node), style="bold")]
    for sl in sorted(p.ledger.nodes[node].gpus, key=lambda s: s.index):
        head = p.ledger.headroom_bytes(sl.node, sl.index)
        line = Text(gpu_row_label(p, sl).ljust(label_width) + "  ")
        line.append_text(bar(gpu_segments(p, sl, palette), width, palette))
        line.append(f"  {gib(p.ledger.used_bytes(sl.node, sl.index))}/{gib(sl.budget_bytes)} GiB, ")
        line.append(f"{gib(head)} left", style="red" if head < 0 else "")
        marks = gpu_marks(p, sl, palette)
        if marks:
            line.append(f"  {marks}")
        out.append(line)
    return out


def key_columns(palette: dict[str, Look]) -> Columns:
    """Every deployment's letter and name, in columns as wide as the terminal allows."""
    return Columns([key_item(look) for look in palette.values()], padding=(0, 3))


def key_item(look: Look) -> Text:
    """'A default/chat': the letter in the deployment's colour, then its name."""
    return Text.assemble((f" {look.letter} ", letter_style(look)), " ", look.key)


def node_table(
    p: Plan, node: str, palette: dict[str, Look], width: int, wide: bool, label_width: int = 5
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
        used.append(f"{gib(head)} left", style="red" if head < 0 else "")
        row: list[Text | str] = [label, bar(gpu_segments(p, sl, palette), width, palette), used]
        if wide:
            deps = sorted({b.deployment for b in p.ledger.bookings_on(sl.node, sl.index)})
            row.append(Text(", ").join([key_item(palette[d]) if d in palette else Text(d) for d in deps]))
        table.add_row(*row)
    return table



def print_deployment(console: Console, p: Plan, key: str, palette: dict[str, Look]) -> None:
    """Two to four lines: phase, letter, name, model; where and how much; flags; then why not and fixes."""
    d = p.decisions[key]
    req = p.requests.get(key)
    head = Text(f"{d.phase:<13} ", style=PHASE_STYLE.get(d.phase, ""))
    look = palette.get(key)
    head.append(look.letter if look else "-", style=letter_style(look) if look else "")
    head.append(" ")
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
        if sizing.granted_tokens:
            line += f" = {sizing.granted_tokens} tokens (max concurrency {sizing.max_concurrency:.1f})"
        console.print(line, highlight=False)
        for pod in pod_lines(d):
            console.print(f"    {pod}", highlight=False)
        if sizing.grant:
            console.print(f"  {grant_line(sizing)}", highlight=False)
    if d.flags is not None and d.admitted:
        console.print(Text("  " + " ".join(d.flags.args()), style="cyan"), soft_wrap=True)
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
                console.print(Text(f"    {s}", style="green"), soft_wrap=True)
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
            f"vLLM {est.version.label}, policy {s.policy}, budget policy {getattr(est.policy, 'name', 'counted')}",
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
        console.print(Text(label, style="bold") + Text(" ".join(sizing.flags.args())), soft_wrap=True)
    if sizing.granted_tokens and sizing.fits:
        console.print(
            f"KV cache: {sizing.granted_tokens} tokens, max concurrency {sizing.max_concurrency:.2f} "
            f"({sizing.kv_bytes_per_token} bytes per token)"
            + (f"; {sizing.concurrency_typical:.1f} requests of the typical {sizing.typical_len} tokens"
               if sizing.concurrency_typical is not None else ""),
            highlight=False,
        )
    if sizing.grant and sizing.fits:
        console.print(grant_line(sizing), highlight=False)
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
    if est.nodes > 1:
        console.print(f"spans {est.nodes} nodes: one pod of {s.gpus // est.nodes} GPUs per node", highlight=False)
    for k, sf in enumerate(est.stages):
        console.print(f"pipeline stage {k}: {gib(sf.total)} GiB per GPU (weights {gib(sf.weights)}, "
                      f"KV cache {gib(sf.kv_cache)})", highlight=False)
    if sizing.fits:
        console.print(Text(f"fits: {gib(est.headroom_bytes)} GiB of budget left per GPU", style="bold green"))
    else:
        console.print(Text("does not fit", style="bold red"))
    for r in sizing.reasons:
        console.print(f"  - {r}", highlight=False)
    if est.suggestions:
        console.print("fits with (each checked):")
        for sug in est.suggestions:
            console.print(Text(f"  {as_flags(sug)}", style="green"), soft_wrap=True)
    for w in est.warnings:
        console.print(Text(f"warning: {w}", style="yellow"))



def grant_line(sizing: Sizing) -> str:
    """'KV grant: 4,096 tokens (maxNumSeqs 4 x maxModelLen 1024); request 2,048 = 2 full-length,
    limit 4,096 = 4': what was granted, by which rule, between which request and limit."""
    line = f"KV grant: {sizing.granted_tokens:,} tokens ({sizing.grant})"
    length = sizing.flags.max_model_len if sizing.flags else 0
    if sizing.request_tokens and length:
        line += (f"; request {sizing.request_tokens:,} = {sizing.request_tokens // length} full-length, "
                 f"limit {sizing.limit_tokens:,} = {sizing.limit_tokens // length}")
    return line


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
        *([("learned over-run (--calibration)", fp.learned)] if fp.learned else []),
        ("= footprint", fp.total),
        ("budget", est.budget_bytes),
        (
            "budget left (budget - footprint)" if fp.total <= est.budget_bytes else "over budget by",
            abs(est.budget_bytes - fp.total),
        ),
        ("held back (capacity - budget)", est.capacity_bytes - est.budget_bytes),
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
        ("GPU KV cache size (null block included)", f"{v.kv_cache_tokens} tokens"),
        ("GPU blocks", str(v.num_gpu_blocks)),
        ("maximum concurrency", f"{v.max_concurrency:.2f}x"),
    ):
        table.add_row(label, val)
    return table

