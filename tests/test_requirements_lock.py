"""The Docker image installs pinned, hashed requirements (issue 14): requirements/runtime.txt and
build.txt pin every package with its sha256 hashes, cover every dependency pyproject.toml names
at a version it allows, and the Dockerfile installs them with --require-hashes and nothing else
from an index."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
REQ = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s\\;]+)(?:\s*;[^\\]*)?\s*\\?$")


def locked(path: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes), parsed the way pip reads a requirements file with line continuations."""
    out: dict[str, tuple[str, list[str]]] = {}
    text = path.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        head, *opts = line.split("--hash=")
        m = REQ.match(head.strip() + " \\")
        assert m, f"{path.name}: not a pinned requirement: {line[:80]}"
        hashes = [o.strip() for o in opts]
        assert hashes and all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), line[:80]
        out[canonicalize_name(m.group(1))] = (m.group(2), hashes)
    return out


def test_every_locked_package_is_pinned_with_hashes() -> None:
    for name in ("runtime.txt", "build.txt"):
        assert locked(ROOT / "requirements" / name)


def test_the_lock_covers_pyproject_at_allowed_versions() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    lock = locked(ROOT / "requirements" / "runtime.txt")
    for dep in map(Requirement, deps):
        name = canonicalize_name(dep.name)
        assert name in lock, f"{dep.name} is not in requirements/runtime.txt: run `make lock`"
        assert dep.specifier.contains(lock[name][0], prereleases=True), f"{dep} vs locked {lock[name][0]}"
    build = locked(ROOT / "requirements" / "build.txt")
    assert "setuptools" in build


def test_the_dockerfile_installs_only_hashed_requirements() -> None:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    installs = [line for line in text.splitlines() if "pip install" in line]
    assert installs
    for line in installs:
        for cmd in line.split("&&"):
            if "pip install" not in cmd:
                continue
            from_index = "--no-index" not in cmd
            assert not from_index or "--require-hashes" in cmd, cmd.strip()
    assert "requirements/runtime.txt" in text and "requirements/build.txt" in text
    assert "VLLMFIT_CATALOG" not in text  # the catalog ships in the wheel
