"""The layout of every picture, free of any format: what each bar is (its segments: owner, bytes,
colour, label), the deployments' palette, the summary, node titles and refusal lines.

The terminal (`terminal`), SVG (`svg`) and HTML (`html`) renderers draw these and decide nothing,
so they cannot disagree. Bytes come in as integers; GiB appear only at the display edge (`gib`).
Every GPU bar is one GPU, left to right: per deployment its weights, KV cache and activation +
overhead, then foreign use, free budget and the reserve (capacity - budget).
"""

from __future__ import annotations

import colorsys
import hashlib
import string
from collections.abc import Sequence
from dataclasses import dataclass

from vllmfit.core import memory
from vllmfit.core.defaults import GIB
from vllmfit.core.memory import Estimate
from vllmfit.core.placement import Decision, GpuSlot, Plan, where

BAR_WIDTH = 48
PALETTE = (
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
    "#8833aa", "#666600", "#006655", "#aaaaff", "#44bbff", "#aa2255", "#aa3300", "#ff99ff", "#aa8822",
    "#007700", "#885500",
)
"""One colour per deployment, picked by its name's hash (palette_colors): Tableau 10 without its grey, then eleven colours
each chosen (on a 17-step sRGB grid, chroma 30-75, lightness 38-78) to be the farthest in CIEDE2000
from every colour before it and from the grey, white and light grey of foreign use, free and
reserve. Any two differ by a colour difference of at least 17 (10 is "clearly different")."""
GOLDEN_ANGLE = 137.50776405003785
"""360 x (1 - 1/phi) degrees: the hue step of colours past PALETTE (successive multiples never repeat)."""
OVERFLOW_LIGHTNESS = (0.34, 0.62, 0.46, 0.72, 0.28)
"""Lightness steps the colours past PALETTE cycle through, so two of them close in hue differ in lightness."""
COMPONENTS = (  # (key, label, terminal character, SVG opacity)
    ("weights", "weights", "█", 1.0),
    ("kv_cache", "KV cache", "▓", 0.65),
    ("runtime", "activation + overhead", "▒", 0.35),
)
LEGEND_INK = "#2b2b2b"
"""The legend's swatches of weights, KV cache and runtime: a neutral ink at each component's
opacity, no deployment's colour (each deployment's own swatch is in its key entry)."""
OVERHEAD_CHAR = "▚"
"""`estimate`'s overhead, apart from its activation (▒): told apart without colour too."""
LEARNED_CHAR = "▞"
"""`estimate`'s learned over-run (--calibration): its own glyph as well."""
FOREIGN = ("grey50", "#6b6b6b", "#")
FREE = ("grey35", "#ffffff", "·")
RESERVE = ("grey62", "#a8a8a8", "░")
"""(rich colour, hex, terminal character): foreign use is solid dark grey, free is empty (white),
the reserve is hatched light grey in SVG and HTML; no deployment colour is grey or white."""


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def count(n: int, word: str) -> str:
    """'1 node', '2 nodes': a number and its noun, plural but for one."""
    return f"{n} {word}{'' if n == 1 else 's'}"


@dataclass(frozen=True)
class Segment:
    label: str  # what the tooltip / legend says
    bytes: int
    style: str  # rich colour
    color: str  # hex
    char: str
    opacity: float = 1.0
    owner: str = ""  # the deployment ("namespace/name") whose bytes these are; "" for foreign, free, reserve
    pattern: str = ""  # "hatch": drawn hatched (the reserve)


@dataclass(frozen=True)
class Look:
    """How one deployment is drawn everywhere: its colour, the text ink on that colour, its letter."""

    key: str  # "namespace/name"
    letter: str  # "A", "B", ... "Z", "AA", ...: the deployment in plain text and where its name does not fit
    color: str  # "#rrggbb"; rich prints it in truecolor or the nearest colour the terminal has
    ink: str  # "#000000" or "#ffffff": whichever reads better on `color`
    short: str  # the name without its namespace where that is unique in the plan, else the key

    def label_for(self, room: int) -> str:
        """What a bar prints at the start of this deployment's run of `room` characters: its short
        name where that leaves two characters of the bar in view, else its letter ("" in no room)."""
        fits = room - 2 if room > 2 else room
        return next((t for t in (self.short, self.letter) if len(t) <= fits), "")


# --- Segments: the one place that decides what a bar shows ---------------------------------------


def _hex(r: float, g: float, b: float) -> str:
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def name_hash(key: str) -> int:
    """A stable number for a deployment's name (sha256: the same in every run and on every machine,
    unlike Python's salted hash())."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


def _in_hash_order(keys: Sequence[str]) -> list[str]:
    return sorted(set(keys), key=lambda k: (name_hash(k), k))


def palette_colors(keys: Sequence[str]) -> dict[str, str]:
    """Keys -> "#rrggbb", from each name's hash, not its position: a deployment keeps its colour
    when others come and go. Each takes the first free colour of PALETTE from the one its hash
    picks on (names claim in hash order, so only a name that meets a taken colour moves on); past
    PALETTE, hues a golden angle apart at cycling lightness. Every colour differs from all others."""
    out: dict[str, str] = {}
    used: set[str] = set()
    extra = 0
    for key in _in_hash_order(keys):
        start = name_hash(key) % len(PALETTE)
        free = [PALETTE[(start + k) % len(PALETTE)] for k in range(len(PALETTE))]
        color = next((c for c in free if c not in used), None)
        while color is None or color in used:  # past PALETTE (more deployments than it holds)
            hue = (extra * GOLDEN_ANGLE) % 360.0
            color = _hex(*colorsys.hls_to_rgb(hue / 360.0, OVERFLOW_LIGHTNESS[extra % len(OVERFLOW_LIGHTNESS)], 0.6))
            extra += 1
        used.add(color)
        out[key] = color
    return out


MARKS = string.ascii_uppercase
"""The marks of deployments: capital letters only (never a digit, never two that differ only by
case); past 26 deployments, two letters."""


def letters(keys: Sequence[str]) -> dict[str, str]:
    """Keys -> a mark from the name itself, not its position, so a deployment keeps its mark when
    others come and go: the first letter of its name (without the namespace), upper case
    ('default/llama-8b' -> 'L'); where that is taken, the name's other letters, then any free letter
    from where its hash points. Names claim in hash order. Past 26 deployments, two letters (past
    702, three)."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    for key in _in_hash_order(keys):
        own = [c.upper() for c in key.rsplit("/", 1)[-1] if c.isascii() and c.isalpha()]
        start = name_hash(key) % len(MARKS)
        wanted = [*own, *(MARKS[(start + k) % len(MARKS)] for k in range(len(MARKS)))]
        mark = next((c for c in wanted if c not in taken), None)
        n, pairs = 0, len(MARKS) ** 2
        while mark is None or mark in taken:  # every pair from where the hash points, then three letters, ...
            mark = _spelled((start + n) % pairs if n < pairs else n)
            n += 1
        taken.add(mark)
        out[key] = mark
    return out


def _spelled(i: int) -> str:
    """The i-th mark of two or more letters: 0 -> 'AA', 675 -> 'ZZ', 676 -> 'AAA', ..."""
    width = 2
    while i >= len(MARKS) ** width:
        i -= len(MARKS) ** width
        width += 1
    out = ""
    for _ in range(width):
        i, d = divmod(i, len(MARKS))
        out = MARKS[d] + out
    return out


def ink(color: str) -> str:
    """Black or white text on `color`, whichever contrasts more (WCAG relative luminance)."""

    def lin(c: int) -> float:
        x = c / 255
        return x / 12.92 if x <= 0.04045 else ((x + 0.055) / 1.055) ** 2.4

    r, g, b = (lin(int(color[i:i + 2], 16)) for i in (1, 3, 5))
    lum = 0.2126 * r + 0.7152 * g + 0.0722 * b
    return "#000000" if (lum + 0.05) / 0.05 >= 1.05 / (lum + 0.05) else "#ffffff"


def looks(p: Plan) -> dict[str, Look]:
    """Every deployment that holds GPUs -> its Look, in name order (deterministic)."""
    names = sorted(set(p.ledger.deployments()) | {k for k, d in p.decisions.items() if d.replicas})
    colors_ = palette_colors(names)
    marks = letters(names)
    tails = [n.rsplit("/", 1)[-1] for n in names]
    return {
        n: Look(n, marks[n], colors_[n], ink(colors_[n]), t if tails.count(t) == 1 else n)
        for n, t in zip(names, tails)
    }


def gpu_segments(p: Plan, sl: GpuSlot, palette: dict[str, Look]) -> list[Segment]:
    segs = []
    for b in p.ledger.bookings_on(sl.node, sl.index):
        look = palette.get(b.deployment)
        color = look.color if look else "#cccccc"
        fp = b.footprint
        name = b.deployment + (f" #{b.replica}" if b.replica else "")
        for (_, label, char, opacity), val in zip(
            COMPONENTS, (fp.weights, fp.kv_cache, fp.activation + fp.overhead)
        ):
            segs.append(Segment(f"{name} {label}", val, color, color, char, opacity, owner=b.deployment))
    used = p.ledger.used_bytes(sl.node, sl.index)
    segs.append(Segment("foreign use", sl.foreign_bytes, FOREIGN[0], FOREIGN[1], FOREIGN[2]))
    segs.append(Segment("free", max(sl.budget_bytes - used, 0), FREE[0], FREE[1], FREE[2]))
    segs.append(Segment("reserve", sl.capacity_bytes - max(sl.budget_bytes, used), RESERVE[0], RESERVE[1],
                        RESERVE[2], pattern="hatch"))
    return [s for s in segs if s.bytes > 0]


def estimate_segments(est: Estimate) -> list[Segment]:
    fp = est.sizing.footprint
    free = max(est.budget_bytes - fp.total, 0)
    reserve = est.capacity_bytes - max(est.budget_bytes, fp.total)
    rows = (
        ("weights", fp.weights, "dodger_blue2", "#1c86ee", "█", ""),
        ("KV cache", fp.kv_cache, "green3", "#00cd00", "▓", ""),
        ("activation", fp.activation, "dark_orange", "#ff8c00", "▒", ""),
        ("overhead", fp.overhead, "magenta", "#cd00cd", OVERHEAD_CHAR, ""),
        *([("learned over-run", fp.learned, "red3", "#cd0000", LEARNED_CHAR, "")] if fp.learned else []),
        ("budget left", free, *FREE, ""),
        ("held back", reserve, *RESERVE, "hatch"),
    )
    return [Segment(label, max(val, 0), style, color, char, pattern=pat)
            for label, val, style, color, char, pat in rows]


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


def spans(segments: Sequence[Segment], width: int) -> list[tuple[str, int, list[int]]]:
    """A bar of `width` characters as runs: (owner, characters, characters per segment of the run).

    Consecutive segments of one deployment form one run; every deployment on the GPU gets at least
    one character (its letter), taken from the widest run, so no booking vanishes in rounding."""
    runs: list[list[int]] = []  # indices into segments
    for i, seg in enumerate(segments):
        if runs and seg.owner and segments[runs[-1][0]].owner == seg.owner:
            runs[-1].append(i)
        else:
            runs.append([i])
    sizes = cells([sum(segments[i].bytes for i in run) for run in runs], width)
    for k, run in enumerate(runs):
        if segments[run[0]].owner and sizes[k] == 0 and width >= len(runs):
            widest = max(range(len(runs)), key=lambda j: (sizes[j], -j))
            sizes[widest] -= 1
            sizes[k] = 1
    return [(segments[run[0]].owner, n, cells([segments[i].bytes for i in run], n)) for run, n in zip(runs, sizes)]


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
    """Where each replica runs; a replica across nodes as its pods joined by ' + ', the leader first."""
    return "; ".join(" + ".join(where(m.node, m.gpus) for m in r.members) for r in d.replicas) or "-"


def pod_lines(d: Decision) -> list[str]:
    """A replica across nodes (its first): one line per pod, leader first, with its GPUs' memory
    (the pipeline stage its ranks run: the stages' weights and KV cache differ)."""
    r = d.replicas[0] if d.replicas else None
    if r is None or not r.workers:
        return []
    out = []
    for k, m in enumerate(r.members):
        fp = max(m.footprints, key=lambda f: f.total)
        out.append(f"{'leader' if k == 0 else f'worker {k}'} {where(m.node, m.gpus)}: {fp.total / GIB:.1f} GiB per GPU "
                   f"(weights {fp.weights / GIB:.1f}, KV cache {fp.kv_cache / GIB:.1f})")
    return out



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
            f"{count(self.nodes, 'node')}, {count(self.gpus, 'GPU')} ({self.gpus_in_use} in use): used {gib(self.used_bytes)} GiB, "
            f"budget left {gib(self.free_bytes)} GiB of {gib(self.budget_bytes)} GiB; "
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

