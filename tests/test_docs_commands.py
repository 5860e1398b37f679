"""Every `vllmfit ...` command in a fenced shell block (```sh, ```bash, ```shell, ```console) of
README.md and docs/*.md runs verbatim: with the installed entry point, offline, in a
temporary directory holding a copy of examples/ (so relative paths and output files work as on a
fresh clone). A command passes when it exits 0 or 1 (1: "does not fit", a verdict) with no
traceback and no "error:" line; 2 is bad input, which a documented command must never be. A
plan or estimate command states its verdict in a trailing comment (`# fits`, `# admitted`: exit 0;
`# refused`, `# does not fit`: exit 1), and the exit code must be that verdict.

Commands that need a cluster are skipped, each with its reason in NEEDS_A_CLUSTER. Usage
synopses ("[--tp N]", "A | B") belong in ```text blocks, which are not run.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"sh", "bash", "shell", "console"}
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)

NEEDS_A_CLUSTER = {
    "status": "reads a live cluster through the kubeconfig",
    "operator": "runs the Kopf operator against a cluster",
    "agent": "reads NVML on a GPU node and patches its Node",
    "reserve": "holds a GPU inside a reservation pod",
}
"""Subcommands not run here, and why."""


def _entry_point() -> str:
    """The installed `vllmfit` console script of this interpreter's environment."""
    here = Path(sys.executable).parent / "vllmfit"
    found = str(here) if here.exists() else shutil.which("vllmfit")
    assert found, "the vllmfit entry point is not installed (pip install -e .)"
    return found


def commands() -> list[tuple[str, str]]:
    """(where, command) for every vllmfit command line of a fenced shell block; backslash
    continuations joined, a trailing `# comment` dropped (and kept in COMMENTS)."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) not in SHELL:
                continue
            line_no = text.count("\n", 0, m.start(2)) + 1
            lines = m.group(2).splitlines()
            i = 0
            while i < len(lines):
                start, cmd = i, lines[i]
                while cmd.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    cmd = cmd.rstrip()[:-1] + " " + lines[i].strip()
                i += 1
                cmd = cmd.strip().removeprefix("$ ")
                words = shlex.split(cmd, comments=True) if cmd else []
                if words and Path(words[0]).name == "vllmfit":
                    where = f"{path.relative_to(ROOT)}:{line_no + start}"
                    out.append((where, shlex.join(words)))
                    COMMENTS[where] = cmd.split(" # ", 1)[1].strip() if " # " in cmd else ""
    return out


COMMENTS: dict[str, str] = {}
"""where -> the command's trailing comment ('' when it has none)."""
COMMANDS = commands()
VERDICTS = (("does not fit", 1), ("refused", 1), ("fits", 0), ("admitted", 0))
"""How a comment states a command's verdict (its first words), and the exit code that verdict is."""


def stated_verdict(comment: str) -> int | None:
    """The exit code a comment's first words state ('refused: ...' -> 1), or None."""
    return next((code for words, code in VERDICTS if comment.lower().startswith(words)), None)


def test_every_plan_and_estimate_in_the_docs_states_its_verdict() -> None:
    missing = [f"{w}: {c}" for w, c in COMMANDS if c.split()[1:2] in (["plan"], ["estimate"])
               and stated_verdict(COMMENTS[w]) is None]
    assert not missing, "say '# fits', '# admitted', '# refused' or '# does not fit' after:\n" + "\n".join(missing)


def test_every_file_a_documented_command_writes_is_ignored_by_git() -> None:
    names = sorted({ws[i + 1] for _, c in COMMANDS for ws in [shlex.split(c)] for i, w in enumerate(ws[:-1])
                    if w == "--out-file"})
    assert names
    run = subprocess.run(["git", "check-ignore", "--no-index", *names], cwd=ROOT, capture_output=True, text=True,
                         check=False)
    assert sorted(run.stdout.split()) == names, "add to .gitignore: " + " ".join(set(names) - set(run.stdout.split()))


def test_the_readme_has_commands_to_run() -> None:
    readme = [c for w, c in COMMANDS if w.startswith("README.md")]
    assert any(" estimate " in c for c in readme) and any(" plan " in c for c in readme)


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_documented_command_runs_verbatim(where: str, command: str, tmp_path: Path) -> None:
    words = shlex.split(command)
    sub = next((w for w in words[1:] if not w.startswith("-")), "")
    if sub in NEEDS_A_CLUSTER:
        pytest.skip(f"vllmfit {sub}: {NEEDS_A_CLUSTER[sub]}")
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "KUBECONFIG"))}
    env |= {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1", "COLUMNS": "120",
            "KUBECONFIG": str(tmp_path / "no-kubeconfig")}
    run = subprocess.run([_entry_point(), *words[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode in (0, 1), f"{where}: {command}\n{run.stderr}"
    assert "Traceback" not in run.stderr and "error:" not in run.stderr, f"{where}: {command}\n{run.stderr}"
    stated = stated_verdict(COMMENTS[where])
    if stated is not None:  # the comment's verdict is the command's
        assert run.returncode == stated, f"{where}: {command}: the comment says {COMMENTS[where]!r}, " \
                                         f"the exit code is {run.returncode}"
    outputs = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--out-file"]
    for name in outputs:
        assert (tmp_path / name).stat().st_size > 0, f"{where}: {command} wrote no {name}"
