"""`vllmfit`: the entry point above every shell. Each subcommand lives in its shell's package
(`vllmfit.cli`, `vllmfit.operator`, `vllmfit.agent`) and registers itself through
`add_parser(subparsers)`, setting `func` (args -> exit code) on its parser.

Bad input never gives a traceback: a `UserError` (or ValueError/LookupError from the core) is
printed as one line `vllmfit: error: ...` and the exit code is 2. So is a bad flag or choice
(`vllmfit estimate: error: argument --quantization: invalid choice: ...`): one line, not the usage.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from vllmfit import __version__
from vllmfit.core.errors import UserError

# Each module registers the subcommands listed with it. Only the module of the command being run
# is imported, so `vllmfit estimate` answers without importing kopf, kubernetes or pynvml.
SUBCOMMANDS = {
    "vllmfit.cli.estimate": ("estimate", "models", "gpus", "plan", "status", "crd", "calibration"),
    "vllmfit.operator.main": ("operator",),
    "vllmfit.agent.main": ("agent",),
    "vllmfit.agent.reserve": ("reserve",),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line and a pointer to --help (its subcommands' parsers
    are of the same class: argparse makes them with type(parent))."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def program_name(argv0: str) -> str:
    """How the user called us, for usage and error lines: `vllmfit`, or `kubectl vllmfit` when
    run as the kubectl plugin (the console script kubectl-vllmfit, found by kubectl on PATH; a
    plugin named kubectl-a_b is called as `kubectl a-b`)."""
    name = os.path.basename(argv0 or "")
    if name.startswith("kubectl-") and len(name) > len("kubectl-"):
        return "kubectl " + name.removeprefix("kubectl-").replace("_", "-")
    return "vllmfit"


def build_parser(command: str | None = None, prog: str = "vllmfit") -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=prog, description="Fit vLLM deployments onto shared GPUs without out-of-memory."
    )
    parser.add_argument("--version", action="version", version=f"vllmfit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = [m for m, names in SUBCOMMANDS.items() if command in names] or list(SUBCOMMANDS)
    for mod in modules:
        try:
            importlib.import_module(mod).add_parser(sub)
        except ModuleNotFoundError as e:  # a shell not installed in this environment
            if not (e.name or "").startswith("vllmfit"):
                raise
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = program_name(sys.argv[0] if sys.argv else "")
    parser = build_parser(argv[0] if argv else None, prog)
    args = parser.parse_args(argv)
    try:
        code = int(args.func(args) or 0)
    except BrokenPipeError:  # `vllmfit models | head`: the reader left, a normal end; say nothing
        _silence_stdout()
        return 0
    except RecursionError:
        print(f"{prog}: error: input nested too deeply", file=sys.stderr)
        return 2
    except (UserError, ValueError, LookupError, OSError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # `vllmfit plan ... | head`: the verdict stands (cli.output)
        _silence_stdout()
    return code


def _silence_stdout() -> None:
    from vllmfit.cli.output import silence_stdout

    silence_stdout()


if __name__ == "__main__":
    sys.exit(main())
