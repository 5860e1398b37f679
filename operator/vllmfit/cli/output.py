"""Where the CLI writes: a rich Console that never wraps for machines, and the end of a pipe.

- A terminal: rich's Console at the terminal's width, with colour. Lines of vLLM flags and fixes
  are printed whole (`soft_wrap`): the terminal folds them on screen, a copy gives one line.
- Anything else (a pipe, a file, a CI log): no colour, no wrapping at all: every line is as long
  as it is (tables and bars are laid out for `COLUMNS` columns when it is set, at least
  `MIN_WIDTH`, else `MACHINE_WIDTH`), so `grep`, `head` and a log viewer see each error, flag
  list, legend entry and name on one line: no line continues the one before it.
- Input errors go to stderr (`errors`), one line each, so `> plan.txt` never hides them.
- A reader that leaves early (`vllmfit plan | head`) is a normal end: nothing more is written and
  the exit code is the command's verdict (0 all fit, 1 something does not fit, 2 input errors),
  not a traceback or 141.
- Errors in the CLI's words (`hub_words`): the Hugging Face Hub's messages are written for the
  operator ("will retry; set spec.modelConfig"); `estimate` names its flags instead, `plan` the
  spec's fields, and neither retries.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import IO, Any

from rich.console import Console

MACHINE_WIDTH = 160
"""The layout width (bars, tables) when stdout is not a terminal and COLUMNS is not set; lines are
never wrapped there."""
MIN_WIDTH = 80
"""The narrowest layout a pipe gets, whatever COLUMNS says (tables of `estimate` need this much)."""


def pipe_width() -> int:
    """COLUMNS when it is a number (at least MIN_WIDTH), else MACHINE_WIDTH."""
    text = os.environ.get("COLUMNS", "").strip()
    return max(MIN_WIDTH, min(int(text), 10_000)) if text.isdigit() else MACHINE_WIDTH


def errors(lines: list[str], prog: str = "vllmfit") -> None:
    """Input errors on stderr, one line each (`vllmfit plan: error: FILE document N: ...`)."""
    for line in lines:
        print(f"{prog}: error: {' '.join(line.split())}", file=sys.stderr)


def wrote(path: str, verdict: int, what: str = "plan") -> None:
    """On stderr: where the output went, and what the exit code will say."""
    meaning = {0: "every deployment fits", 1: "something does not fit (exit 1)",
               2: "input errors, listed above (exit 2)"}[verdict]
    print(f"wrote {what} to {path}: {meaning}", file=sys.stderr)


class PipeConsole(Console):
    """rich's Console, except that a reader who left is a normal end: rich's own handler exits
    with status 1 (`SystemExit(1)`, the code for "does not fit"); this one goes quiet instead and
    the command returns its verdict."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        silence_stdout()


def console(file: IO[str] | None = None) -> Console:
    """The Console for `file` (stdout when None): a terminal's width and colours, else no wrapping."""
    target = file if file is not None else sys.stdout
    if file is None and target.isatty():
        return PipeConsole()
    return PipeConsole(file=target, width=pipe_width(), soft_wrap=True, color_system=None if file else "auto")


def silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail again
    (the recipe of the Python documentation, "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def write_then(verdict: int, write: Callable[[], Any]) -> int:
    """Run `write` (the command's output) and return `verdict`; a reader that closed the pipe
    ends the output quietly and the verdict stands."""
    try:
        write()
        sys.stdout.flush()
    except BrokenPipeError:
        silence_stdout()
    return verdict


HUB_WORDS = {  # the Hub's messages are the operator's (it retries, it holds the token) -> the CLI's
    "flags": (("; will retry; set spec.modelConfig to avoid the Hub", ("; work offline with --model-config PATH "
               "(a config.json) or a catalog name (vllmfit models)")),
              ("give the operator a token (HF_TOKEN)", "set HF_TOKEN"), ("the operator's token", "HF_TOKEN"),
              ("check spec.model or set spec.modelConfig", "check --model or pass --model-config PATH"),
              ("or set spec.modelConfig", "or pass --model-config PATH (a config.json)"),
              ("set spec.modelConfig", "pass --model-config PATH")),
    "spec": (("; will retry; set spec.modelConfig to avoid the Hub", "; set spec.modelConfig to plan offline"),
             ("give the operator a token (HF_TOKEN)", "set HF_TOKEN"), ("the operator's token", "HF_TOKEN")),
}
"""The CLI's words for the Hub's errors: `estimate` names its flags, `plan` the spec's fields; neither
retries, and the token is the user's own HF_TOKEN."""


def hub_words(message: str, words: str = "flags") -> str:
    for old, new in HUB_WORDS[words]:
        message = message.replace(old, new)
    return message
