"""Mutation testing of the pure core (issue 22): how many small changes to core/placement and
core/memory (a `<` for a `<=`, a `+ 1` dropped, a constant changed) the tests notice.

mutmut (PyPI, the `dev` extra) runs in a throw-away copy, never in the working tree: the package
is copied to <work>/src/vllmfit (the working tree's, or a git revision's with --rev) and the tests
to <work>/tests; mutmut mutates its own copy of that under <work>/mutants. For each mutant it runs
only the selected tests that reach the mutated function (it records which tests reach which
function first), so a run of the safety-bound modules takes minutes on two cores, not hours.

- `--modules`: which modules to mutate (default: the ones that hold a safety bound: the ledger,
  the search and placement over it, the budget, KV sizing, the margin and the sizing).
  `--modules all` mutates every module of core/placement and core/memory.
- the tests: the placement and memory tests (the scale smoke test excluded), see TESTS.
- `--budget-s`: the wall time mutants may run; mutants not run by then are counted as not run.
- `--sample N`: at most N mutants per module, drawn with `--seed` (every mutant when 0).
- `--drop-tests FILES`: leave these test files out: with the same --rev and --seed, the same
  mutants are run with and without them (what new tests kill).

Score = (killed + timeout) / (killed + timeout + survived + suspicious); mutants in functions no
selected test reaches ("no tests") are counted apart, as are mutants not run. Prints a table per
module, then each surviving mutant as a diff (those in a safety-bound function marked `SAFETY`),
then as its last line one JSON object whose keys end in their units.

    .venv/bin/python benchmarks/mutation.py [--modules ledger,budget] [--rev REV] [--budget-s 900]
        [--sample 0] [--seed 22] [--drop-tests FILES] [--max-children 2] [--keep DIR] [--show 200]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "src/vllmfit"

MODULES = {  # short name -> module path under vllmfit/
    "ledger": "core/placement/ledger.py",
    "search": "core/placement/search.py",
    "place": "core/placement/place.py",
    "decide": "core/placement/decide.py",
    "budget": "core/memory/budget.py",
    "kv": "core/memory/kv.py",
    "margin": "core/memory/margin.py",
    "sizing": "core/memory/sizing.py",
}
DEFAULT = ["ledger", "search", "place", "budget", "kv", "margin", "sizing"]

# Functions that hold a safety bound: a survivor in one of these is a test to write.
SAFETY = {
    "core/placement/ledger.py": r"book|headroom_bytes|used_bytes|over_budget|overfull_deployments|affected|_add|release"
                                r"|restore|_index|_unindex|_reindex|_node_group_key|_set_group_key|group_index",
    # the search and placement: what picks a GPU with room and checks a pinned group (not the
    # preferences among fits, nor selector matching)
    "core/placement/search.py": r"_pick|_first|_search|_min_need|_full_sizing",
    "core/placement/place.py": r"_check_pinned|_per_gpu|_decide|_kv_too_large|_place_replicas|_pinned",
    "core/placement/decide.py": r"$^",
    "core/memory/budget.py": r"budget_bytes|budget|held_back|error|utilization_for|utilization_within|requested_bytes",
    "core/memory/kv.py": r".*",
    "core/memory/margin.py": r".*",
    "core/memory/sizing.py": r".*",
}

TESTS = [
    "tests/placement",
    "tests/test_memory.py",
    "tests/test_safety_arithmetic.py",
    "tests/test_hybrid.py",
    "tests/test_kv_request.py",
    "tests/test_calibration.py",
    "tests/test_lora_offload.py",
]
EXTRA = ["examples", "benchmarks"]  # read by tests (the example cluster, the scale benchmark's builders)
DESELECT = ["tests/placement/test_placement_bench.py"]  # a 13 s scale smoke test, run by the suite

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
          35: "suspicious", 36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout",
          None: "not run"}


def status_of(code: int | None) -> str:
    return STATUS.get(code, "suspicious")


def stage_tree(rev: str | None, stage: Path) -> Path:
    """operator/, catalog/, tests/ and EXTRA of the working tree or of `rev`, under `stage`."""
    if rev is None:
        return ROOT
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "operator", "catalog", "tests",
                           *EXTRA],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(stage, filter="fully_trusted")
    return stage


def prepare(work: Path, tree: Path, modules: list[str], tests: list[str], drop: list[str]) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(tree / "operator" / "vllmfit", work / PKG, symlinks=False, ignore=ignore)
    shutil.copytree(tree / "tests", work / "tests", symlinks=False, ignore=ignore)
    for t in drop:
        (work / t).unlink()
    for d in EXTRA:
        shutil.copytree(tree / d, work / d, symlinks=False, ignore=ignore)
    only = [f'"{PKG}/{MODULES[m]}"' for m in modules]
    sel = [f'"{t}"' for t in tests if (work / t).exists()] + [f'"--deselect={d}"' for d in DESELECT]
    (work / "pyproject.toml").write_text(f"""[tool.mutmut]
source_paths = ["src"]
only_mutate = [{", ".join(only)}]
pytest_add_cli_args = ["-p", "no:cacheprovider", "-q", "-x"]
pytest_add_cli_args_test_selection = [{", ".join(sel)}]
use_git_change_detection = false
also_copy = [{", ".join(f'"{d}"' for d in EXTRA)}]
timeout_multiplier = 10.0

[tool.pytest.ini_options]
asyncio_mode = "auto"
asyncio_default_fixture_loop_scope = "function"
filterwarnings = ["ignore::DeprecationWarning"]
""")


def mutmut(work: Path, names: list[str], max_children: int, timeout_s: float) -> tuple[int | None, str]:
    """`mutmut run` in `work`; killed (with its children) after timeout_s. (exit code, output tail)."""
    exe = Path(sys.executable).with_name("mutmut")
    cmd = [str(exe) if exe.exists() else "mutmut", "run", "--max-children", str(max_children), *names]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    with open(work / "mutmut.log", "ab") as log:
        p = subprocess.Popen(cmd, cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            code: int | None = p.wait(timeout=max(timeout_s, 1))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            code = None
    tail = (work / "mutmut.log").read_bytes()[-3000:].decode("utf-8", "replace")
    return code, tail


def results(work: Path, modules: list[str]) -> dict[str, dict[str, int | None]]:
    """{module: {mutant name: exit code or None}} from mutmut's .meta files."""
    out = {}
    for m in modules:
        meta = work / "mutants" / PKG / (MODULES[m] + ".meta")
        out[m] = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
    return out


def function_of(name: str) -> str:
    """'vllmfit.core.placement.ledger.xǁLedgerǁbook__mutmut_3' -> 'Ledger.book'."""
    base = name.rsplit(".", 1)[-1].rsplit("__mutmut_", 1)[0]
    parts = [p for p in base.split("ǁ") if p]
    parts[0] = parts[0][2:] if parts[0].startswith("x_") else parts[0].lstrip("x")
    return ".".join(p for p in parts if p)


def diff(work: Path, name: str, module: str) -> list[str]:
    """The changed lines of a mutant (mutmut's own diff, run in `work` where its copies are)."""
    code = ("import sys\nfrom mutmut.mutation.diff_apply import get_diff_for_mutant\n"
            "print(get_diff_for_mutant(sys.argv[1], path=sys.argv[2]))\n")
    p = subprocess.run([sys.executable, "-c", code, name, f"{PKG}/{module}"], cwd=work, capture_output=True,
                       text=True, check=False)
    lines = p.stdout.splitlines()
    return [ln for ln in lines if ln[:1] in "+-" and not ln.startswith(("+++", "---"))] or [p.stderr.strip()[-200:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modules", default=",".join(DEFAULT),
                    help=f"comma-separated, of {', '.join(MODULES)}; or 'all' (default: %(default)s)")
    ap.add_argument("--rev", help="mutate and test this git revision instead of the working tree")
    ap.add_argument("--drop-tests", default="", metavar="FILES",
                    help="comma-separated test files to leave out (the same code and mutants, fewer tests: "
                         "a before/after comparison of new tests)")
    ap.add_argument("--budget-s", type=float, default=900.0, help="wall time for running mutants (default 900)")
    ap.add_argument("--sample", type=int, default=0, help="at most N mutants per module (0: all)")
    ap.add_argument("--seed", type=int, default=22)
    ap.add_argument("--max-children", type=int, default=2)
    ap.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (default: a temporary directory)")
    ap.add_argument("--show", type=int, default=200, help="print at most N surviving mutants as diffs")
    a = ap.parse_args()

    if a.modules == "all":
        for pkg in ("placement", "memory"):
            for f in sorted((ROOT / "operator" / "vllmfit" / "core" / pkg).glob("*.py")):
                path = f"core/{pkg}/{f.name}"
                if f.name != "__init__.py" and path not in MODULES.values():
                    MODULES[f"{pkg}.{f.stem}" if f.stem in MODULES else f.stem] = path
        modules = list(MODULES)
    else:
        modules = [m.strip() for m in a.modules.split(",") if m.strip()]
        unknown = [m for m in modules if m not in MODULES]
        if unknown:
            ap.error(f"unknown module(s) {', '.join(unknown)}; choose from {', '.join(MODULES)} or 'all'")

    t0 = time.monotonic()
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="vllmfit-mutation-"))
    if a.keep and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)  # mkdtemp made it already
    try:
        with tempfile.TemporaryDirectory() as stage:
            prepare(work, stage_tree(a.rev, Path(stage)), modules, TESTS,
                    [x.strip() for x in a.drop_tests.split(",") if x.strip()])
        # 1. generate the mutants and record which tests reach which function (a filter that matches
        #    nothing stops mutmut right after that); 2. run the chosen mutants until the budget ends.
        mutmut(work, ["vllmfit.no.such.mutant"], a.max_children, a.budget_s)
        generated = results(work, modules)
        log = (work / "mutmut.log").read_text(errors="replace")
        failed = ("failed to collect stats", "Failed to run clean test", "BadTestExecutionCommandsException")
        if any(f in log for f in failed) or not any(generated.values()):
            sys.exit(f"mutmut generated no mutants; see {work / 'mutmut.log'}:\n" + (work / "mutmut.log").read_text()[-3000:])
        rnd = random.Random(a.seed)
        chosen: list[str] = []
        for m in modules:
            names = sorted(generated[m])
            chosen += sorted(rnd.sample(names, a.sample)) if a.sample and len(names) > a.sample else names
        prep_s = time.monotonic() - t0
        code, tail = mutmut(work, chosen, a.max_children, a.budget_s)
        if code not in (0, None):
            print(f"mutmut exited {code}:\n{tail}", file=sys.stderr)
        found = results(work, modules)
        run_s = time.monotonic() - t0 - prep_s

        chosen_set = set(chosen)
        cols = ("killed", "timeout", "survived", "suspicious", "no tests", "not run")
        total = dict.fromkeys(cols, 0)
        print(f"{'module':<32} {'mutants':>7} {'score %':>7} " + " ".join(f"{c:>10}" for c in cols))
        survivors: list[tuple[str, str, str, bool]] = []
        for m in modules:
            counts = dict.fromkeys(cols, 0)
            for name, c in sorted(found[m].items()):
                if name not in chosen_set:
                    continue
                s = status_of(c)
                counts[s if s in counts else "suspicious"] += 1
                if s == "survived":
                    fn = function_of(name)
                    safe = re.fullmatch(SAFETY.get(MODULES[m], r"$^"), fn.rsplit(".", 1)[-1]) is not None
                    survivors.append((m, name, fn, safe))
            for k in cols:
                total[k] += counts[k]
            print(f"{MODULES[m]:<32} {sum(counts.values()):>7} {score(counts):>7.1f} "
                  + " ".join(f"{counts[c]:>10}" for c in cols))
        print(f"{'all':<32} {sum(total.values()):>7} {score(total):>7.1f} " + " ".join(f"{total[c]:>10}" for c in cols))

        safety = [s for s in survivors if s[3]]
        print(f"\nsurviving mutants: {len(survivors)} ({len(safety)} in a safety-bound function)")
        for m, name, fn, safe in sorted(survivors, key=lambda s: (not s[3], s[1]))[: a.show]:
            print(f"{'SAFETY ' if safe else '       '}{MODULES[m]} {fn} ({name.rsplit('__', 1)[-1]})")
            for ln in diff(work, name, MODULES[m]):
                print(f"        {ln.strip()[:150]}")
        if len(survivors) > a.show:
            print(f"... and {len(survivors) - a.show} more (--show)")
        wall = time.monotonic() - t0
        print(json.dumps({
            "modules": ",".join(modules), "rev": a.rev or "working-tree", "dropped_tests": a.drop_tests,
            "score_percent": round(score(total), 1),
            "mutants_total": sum(total.values()), "killed_mutants": total["killed"],
            "timeout_mutants": total["timeout"], "survived_mutants": total["survived"],
            "suspicious_mutants": total["suspicious"], "no_tests_mutants": total["no tests"],
            "not_run_mutants": total["not run"], "safety_survived_mutants": len(safety),
            "prepare_s": round(prep_s, 1), "run_s": round(run_s, 1), "wall_s": round(wall, 1),
        }))
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


def score(c: dict[str, int]) -> float:
    done = c["killed"] + c["timeout"] + c["survived"] + c["suspicious"]
    return 100.0 * (c["killed"] + c["timeout"]) / done if done else 0.0


if __name__ == "__main__":
    main()
