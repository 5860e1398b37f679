"""The one way the CLI reads an input: bounded by limits.MAX_INPUT_BYTES, whatever the path names.

A regular file larger than the bound (a huge or sparse file) is refused from its size before a
byte is read; anything else (stdin as `-`, a FIFO, a pipe such as `<(kubectl ...)`, a device such
as /dev/zero) is read in chunks and refused as soon as it passes the bound. Every failure is a
`UserError`: one line, exit 2. A FIFO nobody writes to waits for a writer, as `cat` does."""

from __future__ import annotations

import argparse
import os
import stat
import sys
from pathlib import Path
from typing import IO, Any

from vllmfit.core import limits
from vllmfit.core.defaults import MIB
from vllmfit.core.errors import UserError

CHUNK = 1 << 20


def _too_big(name: str, limit: int) -> UserError:
    return UserError(f"cannot read {name}: larger than {limit} bytes ({limit / MIB:g} MiB), the most vllmfit "
                     "reads from one input; pass a file (a kubectl export, a config.json), not a device or a "
                     "stream that does not end")


def _read_bounded(stream: IO[Any], name: str, limit: int) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        chunk = stream.read(min(CHUNK, limit + 1 - total))
        if not chunk:
            return b"".join(parts)
        if isinstance(chunk, str):  # a text stream without .buffer (a test's StringIO)
            chunk = chunk.encode("utf-8", "surrogateescape")
        parts.append(chunk)
        total += len(chunk)
        if total > limit:
            raise _too_big(name, limit)


def read_input(path: str | os.PathLike[str], limit: int | None = None) -> str:
    """The UTF-8 text of `path` ('-' is stdin), at most `limit` (limits.MAX_INPUT_BYTES) bytes of it."""
    limit = limits.MAX_INPUT_BYTES if limit is None else limit
    path = os.fspath(path)
    name = "<stdin>" if path == "-" else path
    try:
        if path == "-":
            data = _read_bounded(getattr(sys.stdin, "buffer", sys.stdin), name, limit)
        else:
            with Path(path).open("rb") as f:
                st = os.fstat(f.fileno())
                if stat.S_ISREG(st.st_mode) and st.st_size > limit:
                    raise _too_big(name, limit)
                data = _read_bounded(f, name, limit)
    except OSError as e:
        raise UserError(f"cannot read {name}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"cannot read {name}: not UTF-8 text (byte {e.start} is {data[e.start]:#04x}); "
                        "pass a YAML or JSON file") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as read_text() gives



def hub_argument(p: argparse.ArgumentParser) -> None:
    """--hub (plan and estimate): the only way either reaches the network."""
    p.add_argument("--hub", action="store_true",
                   help="fetch the config.json of a model the catalog does not know (org/name) from the Hugging "
                        "Face Hub (HF_TOKEN for gated models); without it nothing is read from the network")

