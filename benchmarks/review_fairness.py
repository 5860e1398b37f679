"""Bounded, honest admission under load (issue 29): four tenants' loops of the costliest review
against one victim tenant.

A ledger of 1,000 nodes x 8 H100 with 4,000 deployments (benchmarks/webhook_latency.py's store).
Four loops in namespace `attacker` send dry-run CREATE reviews of the costliest spec the limits
allow (Llama-3.1-405B, TP 8, fp8, `limits.MAX_REPLICAS` replicas), back to back, for the whole
run. Meanwhile the victim, in namespace `victim`, sends one review at a time, alternating an honest
spec that fits (Llama-3.1-8B, 8k context) and a spec that fits nowhere (Llama-3.1-405B on one
GPU). Every review goes through `webhook.review` as the Kopf handler calls it, with one shared
`webhook.Admission` (the operator's bounds: budget, per-namespace places, its thread pool), on
the event loop of this process, so the decision threads share the GIL with the loop as in the
operator.

Printed: the victim's p50 / p99 / max answer time per kind, and how many of its reviews were
allowed, refused as not fitting (403), or refused as not checked in time (429); the attacker's
verdicts. What must hold: the honest spec is answered within the review budget (and allowed);
the spec that fits nowhere is refused, never allowed unchecked. On main (before issue 29) the
victim's reviews waited about 3 s for the ledger's lock and were then allowed unchecked ("ledger
busy; the operator will check"), the one that fits nowhere included.

Prints a table, then as its LAST line one JSON object whose keys end in their units.

    .venv/bin/python benchmarks/review_fairness.py [--nodes 1000] [--deployments 4000] [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "webhook"))

from webhook_harness import vllmd
from webhook_latency import WORST, build_store

from vllmfit.core import defaults
from vllmfit.operator.admission import webhook

HONEST = {"model": "meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 8192, "maxNumSeqs": 16}
NOWHERE = {"model": "meta-llama/Llama-3.1-405B-Instruct", "maxModelLen": 8192}
ATTACKERS = 4


def verdict_kind(v: webhook.Verdict) -> str:
    if v.allowed:
        return "allowed unchecked" if any("unchecked" in w or "will check" in w for w in v.warnings) else "allowed"
    return {403: "refused: does not fit", 429: "refused: not checked in time", 422: "refused: too costly"}.get(
        v.code, f"refused {v.code}")


async def run(store, seconds: float) -> dict:
    # before issue 29 there was no Admission (and no bounds to pass): the same loops run there too
    adm = (webhook.Admission(),) if hasattr(webhook, "Admission") else ()
    stop = time.monotonic() + seconds
    attacker: Counter[str] = Counter()
    victim: dict[str, list[float]] = {"honest": [], "nowhere": []}
    verdicts: dict[str, Counter[str]] = {"honest": Counter(), "nowhere": Counter()}

    async def attack(i: int) -> None:
        n = 0
        while time.monotonic() < stop:
            n += 1
            v = await webhook.review(store, vllmd(f"big-{i}-{n}", "attacker", **WORST), None, "CREATE", True, *adm)
            attacker[verdict_kind(v)] += 1

    async def victim_loop() -> None:
        await asyncio.sleep(0.5)  # the attackers' first reviews are deciding
        n = 0
        while time.monotonic() < stop:
            n += 1
            kind = "honest" if n % 2 else "nowhere"
            spec = HONEST if kind == "honest" else NOWHERE
            t = time.perf_counter()
            v = await webhook.review(store, vllmd(f"v-{n}", "victim", **spec), None, "CREATE", True, *adm)
            victim[kind].append(time.perf_counter() - t)
            verdicts[kind][verdict_kind(v)] += 1
            await asyncio.sleep(0.05)

    await asyncio.gather(*(attack(i) for i in range(ATTACKERS)), victim_loop())
    return {"attacker": attacker, "victim": victim, "verdicts": verdicts}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] * 1000 if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--deployments", type=int, default=4000)
    ap.add_argument("--seconds", type=float, default=20.0)
    a = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))[:2]
        os.sched_setaffinity(0, cpus)
    store, build_s, booked = build_store(a.nodes, a.deployments)
    out = asyncio.run(run(store, a.seconds))
    budget_ms = getattr(defaults, "REVIEW_BUDGET_S", 3.0) * 1000
    print(f"{a.nodes} nodes x 8 H100, {booked} deployments (built in {build_s:.1f} s); {ATTACKERS} loops of "
          f"the costliest review in one namespace for {a.seconds:g} s; review budget {budget_ms:.0f} ms, "
          f"{getattr(defaults, 'REVIEW_PER_NAMESPACE', 'any')} deciding per namespace")
    print(f"{'victim review':<22}{'n':>5}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}  verdicts")
    for kind, xs in out["victim"].items():
        print(f"{kind:<22}{len(xs):>5}{pct(xs, .5):>10.1f}{pct(xs, .99):>10.1f}{pct(xs, 1):>10.1f}  "
              + ", ".join(f"{k}: {n}" for k, n in sorted(out["verdicts"][kind].items())))
    print("attacker verdicts: " + ", ".join(f"{k}: {n}" for k, n in sorted(out["attacker"].items())))
    honest, nowhere = out["verdicts"]["honest"], out["verdicts"]["nowhere"]
    result = {
        "victim_honest_p50_ms": round(pct(out["victim"]["honest"], .5), 2),
        "victim_honest_p99_ms": round(pct(out["victim"]["honest"], .99), 2),
        "victim_nowhere_p50_ms": round(pct(out["victim"]["nowhere"], .5), 2),
        "victim_nowhere_p99_ms": round(pct(out["victim"]["nowhere"], .99), 2),
        "review_budget_ms": budget_ms,
        "victim_honest_allowed_count": honest["allowed"],
        "victim_honest_reviews_count": sum(honest.values()),
        "victim_nowhere_refused_count": sum(n for k, n in nowhere.items() if k.startswith("refused")),
        "victim_nowhere_allowed_unchecked_count": nowhere["allowed unchecked"] + nowhere["allowed"],
        "victim_nowhere_reviews_count": sum(nowhere.values()),
        "attacker_reviews_count": sum(out["attacker"].values()),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
