"""spec.extraArgs checked the way `vllm serve` parses them (pure).

vLLM's `FlexibleArgumentParser` (vllm/utils/argparse_utils.py; researched in
/work/stage/vllm-flags.md section 1) is an argparse parser with `allow_abbrev` on, after a
normalisation pass. So one flag has many spellings, and every one of them must be caught:

- `--flag=value` and `--flag value`;
- underscores in a long option's name become dashes (`--max_model_len`), up to the first `.`;
- dotted JSON keys (`--hf-overrides.num_hidden_layers 2`, `-cc.mode=3`) set the base option;
- any unique prefix of a long option is that option (`--gpu-memory-util=0.99`, `--kv-cache-memory=80G`);
  an ambiguous prefix is an error in vLLM, and is refused here when a refused option is among
  its candidates;
- a single-dash alias takes prefixes too, and its first two characters may carry the value
  (`-t 2` is `-tp 2`, `-qfp8` is `-q fp8`); `-O3` / `-O 3` / `-Odecode` set the compilation or
  optimization level;
- boolean options have `--no-X` forms (and `--enable-X` / `--disable-X` pairs in 0.33).

A flag is refused when vllmfit sets it itself (use the spec field instead: LoRA is spec.lora, CPU
weight offload spec.cpuOffload), when it would stop the pod from serving where vllmfit expects (port,
host, a config file that can set anything), or when it changes GPU memory in a way vllmfit does not
model (speculative decoding: a draft model is a second model to size; KV offload, CUDA-graph and
compilation settings, hf-overrides...). `--lora-modules` and `--max-cpu-loras` (adapters to load,
host memory) are allowed; `--swap-space` too: host memory only (vLLM 0.11-0.17; gone from 0.19). The option table is
the union of vLLM 0.11 to 0.33, so a prefix refused in one version is refused in all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllmfit.core.spec import vllmargs
from vllmfit.core.spec.argclasses import (  # noqa: F401 - the tables, read here by callers and tests
    ALIASES,
    ALLOWED,
    BOUNDED,
    COMMIT,
    COMPUTED,
    KNOWN,
    MODELLED,
    REFUSED,
    VALUE_RULES,
    classify,
    table_markdown,
)


def _spellings(option: str) -> list[str]:
    """Every option string argparse registers for an option: itself, --no-X (booleans use
    BooleanOptionalAction), and the --enable-X / --disable-X twin (0.33)."""
    name = option[2:]
    out = [option, f"--no-{name}"]
    for a, b in (("enable-", "disable-"), ("disable-", "enable-")):
        if name.startswith(a):
            twin = b + name[len(a):]
            out += [f"--{twin}", f"--no-{twin}"]
    return out


def _spelling_table() -> dict[str, str]:
    out = {o: o for o in KNOWN}  # an option string that is an option of its own is itself
    for o in sorted(KNOWN):
        for s in _spellings(o)[1:]:
            out.setdefault(s, o)
    return out


_SPELLINGS: dict[str, str] = _spelling_table()


@dataclass(frozen=True)
class Problem:
    arg: str  # the extraArgs entry as written
    option: str  # the vLLM option it resolves to
    message: str


def _resolve_long(name: str) -> list[str]:
    """The options a long option token can resolve to (argparse: exact, else every option it is
    a prefix of; vLLM errors on an ambiguous prefix)."""
    if name in _SPELLINGS:
        return [_SPELLINGS[name]]
    return sorted({opt for s, opt in _SPELLINGS.items() if s.startswith(name)})


def _resolve_short(token: str) -> list[str]:
    """A single-dash token: an alias exactly, a prefix of aliases, or an alias in its first two
    characters with the value glued on (argparse's _get_option_tuples)."""
    name = token.split("=", 1)[0].split(".", 1)[0]
    if name.startswith("-O"):  # -O3, -O 3, -O=3, -Odecode (vLLM rewrites them before argparse)
        return ["--optimization-level"]
    if name in ALIASES:
        return [ALIASES[name]]
    return sorted({ALIASES[a] for a in ALIASES if a.startswith(name) or a == name[:2]})


def _verdict(arg: str, flag: str, hits: list[str]) -> list[Problem]:
    """Problems of one option token: not an option, ambiguous, or refused (allowed: none)."""
    if not hits:
        return [Problem(arg, flag, f"extraArgs {flag} is not an option of `vllm serve` "
                        f"{vllmargs.VERSIONS[0]}-{vllmargs.VERSIONS[-1]}; remove it")]
    refused = [o for o in hits if o in REFUSED]
    out = []
    for opt in refused:
        alias = "" if flag.split(".", 1)[0] == opt else f"(= {opt}) "
        out.append(Problem(arg, opt, f"extraArgs {flag} {alias}{REFUSED[opt]}"))
    if not refused and len(hits) > 1:
        out.append(Problem(arg, flag, f"extraArgs {flag} is an ambiguous prefix ({', '.join(hits[:4])}"
                           f"{', ...' if len(hits) > 4 else ''}); vLLM refuses it; spell the option out"))
    return out


def problems(args: Sequence[str]) -> list[Problem]:
    """Every extraArgs entry that is not an allowed option of `vllm serve`, however it is spelled:
    a refused option, an allowed one with a refused value, an ambiguous prefix, or no option at all."""
    out: list[Problem] = []
    args = [str(a) for a in args]
    for n, arg in enumerate(args):
        token = str(arg).strip()
        if not token.startswith("-") or token in ("-", "--"):
            continue  # a value, or the end of options
        if token.startswith("--"):
            head = token.split("=", 1)[0]
            base, _, _ = head.partition(".")  # dotted JSON keys set their base option
            base = base.replace("_", "-").lower()  # vLLM: underscores -> dashes before the first '.'
            hits = _resolve_long(base)
            checked = hits[0] if len(hits) == 1 and hits[0] in VALUE_RULES else None
            if len(hits) == 1 and hits[0] in COMMIT:
                value = token.split("=", 1)[1] if "=" in token else (args[n + 1] if n + 1 < len(args) else "")
                if not _is_commit(value.strip()):
                    out.append(Problem(arg, hits[0], f"extraArgs {head} {value.strip()[:60]!r}: {COMMIT[hits[0]]}"))
            if checked is not None:
                value = token.split("=", 1)[1] if "=" in token else (args[n + 1] if n + 1 < len(args) else "")
                allowed, why = VALUE_RULES[checked]
                if value.strip() not in allowed:
                    alias = "" if head == checked else f"(= {checked}) "
                    out.append(Problem(arg, checked, f"extraArgs {head} {alias}{value.strip()[:60]!r} {why}"))
        else:
            if _is_number(token):
                continue  # a negative number is a value
            hits = _resolve_short(token)
        out += _verdict(arg, token.split("=", 1)[0], hits)
    return out


def values_of(args: Sequence[str], option: str) -> list[tuple[str, str]]:
    """(as written, value) of every extraArgs entry that sets long option `option`, however it is
    spelled (a unique prefix, underscores, `=`): the bounded options' values (BOUNDED)."""
    args = [str(a) for a in args]
    out = []
    for n, arg in enumerate(args):
        token = arg.strip()
        if not token.startswith("--"):
            continue
        head = token.split("=", 1)[0]
        if _resolve_long(head.partition(".")[0].replace("_", "-").lower()) == [option]:
            out.append((head, token.split("=", 1)[1] if "=" in token else (args[n + 1] if n + 1 < len(args) else "")))
    return out


def _is_commit(value: str) -> bool:
    return len(value) == 40 and all(c in "0123456789abcdef" for c in value)


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def messages(args: Sequence[str]) -> list[str]:
    """One line per refused entry (deduplicated, in order)."""
    seen: dict[str, None] = {}
    for p in problems(args):
        seen.setdefault(p.message, None)
    return list(seen)
