"""`kubectl-vllmfit`: the CLI as a kubectl plugin (a [project.scripts] entry). kubectl runs any
executable named kubectl-<name> on PATH for `kubectl <name> ...`, with the words after <name>;
the plugin names itself from argv[0], so its usage and error lines say `kubectl vllmfit`.
The last test runs the real kubectl (from the CDK wheel tests/chart uses) on a PATH holding the
plugin, offline; it is skipped where that wheel is not installed."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from vllmfit import main as cli

ROOT = Path(__file__).resolve().parents[1]


def test_the_plugin_is_a_console_script_of_the_package() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kubectl-vllmfit"] == scripts["vllmfit"] == "vllmfit.main:main"


@pytest.mark.parametrize(("argv0", "prog"), [
    ("/usr/local/bin/kubectl-vllmfit", "kubectl vllmfit"),
    ("kubectl-vllmfit", "kubectl vllmfit"),
    ("/home/u/.krew/bin/kubectl-vllm_fit", "kubectl vllm-fit"),  # kubectl's rule for underscores
    ("/usr/bin/vllmfit", "vllmfit"),
    ("kubectl-", "vllmfit"),
    ("", "vllmfit"),
])
def test_the_program_name_follows_argv0(argv0: str, prog: str) -> None:
    assert cli.program_name(argv0) == prog


def run_as(argv0: str, argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
           ) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", [argv0, *argv])
    try:
        code = cli.main()
    except SystemExit as e:  # --help, usage errors
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_usage_and_errors_say_kubectl_vllmfit(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_as("/usr/local/bin/kubectl-vllmfit", ["--help"], monkeypatch, capsys)
    assert code == 0 and out.startswith("usage: kubectl vllmfit ")
    code, out, _ = run_as("/usr/local/bin/kubectl-vllmfit", ["plan", "--help"], monkeypatch, capsys)
    assert code == 0 and out.startswith("usage: kubectl vllmfit plan ")
    code, _, err = run_as("/usr/local/bin/kubectl-vllmfit", ["plan", "-f", "x.yaml", "--bogus"], monkeypatch, capsys)
    assert code == 2 and err == "kubectl vllmfit: error: unrecognized arguments: --bogus (see kubectl vllmfit --help)\n"
    code, _, err = run_as("/usr/local/bin/kubectl-vllmfit", ["plan"], monkeypatch, capsys)
    assert code == 2 and err.startswith("kubectl vllmfit plan: error: the following arguments are required")
    assert err.rstrip().endswith("(see kubectl vllmfit plan --help)")
    code, _, err = run_as("/usr/local/bin/kubectl-vllmfit", ["plan", "-f", "/nonexistent.yaml"], monkeypatch, capsys)
    assert code == 2 and err.startswith("kubectl vllmfit: error: ") and len(err.strip().splitlines()) == 1
    # as `vllmfit` nothing changes
    code, _, err = run_as("/usr/bin/vllmfit", ["plan", "-f", "/nonexistent.yaml"], monkeypatch, capsys)
    assert code == 2 and err.startswith("vllmfit: error: ")


@pytest.fixture
def kubectl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from chart import tools
    finally:
        sys.path.remove(str(ROOT / "tests"))
    try:
        return tools.extract(tmp_path_factory.mktemp("k8s-tools"))["kubectl"]
    except tools.ToolsUnavailable as e:
        pytest.skip(f"kubectl not available: {e}")


def test_kubectl_finds_and_runs_the_plugin(kubectl: Path, tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    installed = Path(sys.executable).parent / "kubectl-vllmfit"
    plugin = bindir / "kubectl-vllmfit"
    if installed.exists():  # the console script pip made
        plugin.symlink_to(installed)
    else:  # what pip writes for a [project.scripts] entry, for a checkout installed before it existed
        plugin.write_text(f"#!{sys.executable}\nimport sys\nfrom vllmfit.main import main\nsys.exit(main())\n")
        plugin.chmod(plugin.stat().st_mode | stat.S_IXUSR)
    env = {"PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", "HOME": str(tmp_path),
           "KUBECONFIG": str(tmp_path / "no-kubeconfig")}
    listed = subprocess.run([str(kubectl), "plugin", "list"], check=False, capture_output=True, text=True,
                            env=env, timeout=60)
    assert str(plugin) in listed.stdout, listed.stdout + listed.stderr
    usage = subprocess.run([str(kubectl), "vllmfit", "status", "--help"], check=False, capture_output=True,
                           text=True, env=env, timeout=60)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: kubectl vllmfit status "), usage.stderr
    argv = ["plan", "-f", str(ROOT / "examples" / "cluster.yaml")]
    via_kubectl = subprocess.run([str(kubectl), "vllmfit", *argv], check=False, capture_output=True, text=True,
                                 env=env, timeout=120)
    direct = subprocess.run([str(plugin), *argv], check=False, capture_output=True, text=True, env=env, timeout=120)
    assert via_kubectl.returncode in (0, 1), via_kubectl.stderr  # 1: the example's llama-70b-128k fits nowhere
    assert (via_kubectl.returncode, via_kubectl.stdout) == (direct.returncode, direct.stdout)
    assert "13 deployments" in via_kubectl.stdout and not via_kubectl.stderr
