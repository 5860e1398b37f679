"""The cluster-wide choices every shell takes as flags, parsed once: the default KV grant
(`--default-kv-grant`, `--default-kv-requests`, `--kv-tenants-per-gpu` -> `memory.KvGrant`) and what a tenant's
podTemplate may reach (`--pod-security-level`, `--allow-host-path`, `--allow-csi-driver`,
`--allow-hf-endpoint`, `--allow-max-logprobs` -> `validate.Policy`). The operator (`vllmfit operator`) and the CLI (`estimate`, `plan`) cannot import
each other, so both call these: the same names, choices, help and one-line errors.

Pure: argparse is the standard library's, and the environment is passed in (`env`), never read
here. The operator passes its environment, so each default is `$VLLMFIT_...` or the core default,
and the help says so; the CLI passes none."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import cast

from vllmfit.core import defaults, limits, memory
from vllmfit.core.errors import UserError
from vllmfit.core.spec import validate

ENV_KV_GRANT = "VLLMFIT_DEFAULT_KV_GRANT"
ENV_KV_REQUESTS = "VLLMFIT_DEFAULT_KV_REQUESTS"
ENV_KV_TENANTS = "VLLMFIT_KV_TENANTS_PER_GPU"
ENV_POD_SECURITY_LEVEL = "VLLMFIT_POD_SECURITY_LEVEL"
LEVELS = ("baseline", "restricted")


def _default(env: Mapping[str, str] | None, name: str, value: object) -> tuple[object, str]:
    """(the default, how the help names it): `$NAME or value` when an environment is given."""
    if env is None:
        return value, "default %(default)s"
    return env.get(name) or value, f"default: ${name} or {value}"


def add_kv_grant_arguments(p: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    """--default-kv-grant / --default-kv-requests / --kv-tenants-per-gpu: the cluster's rule for the KV
    cache of a spec without kvCache (docs/memory-model.md, "The KV request")."""
    g = p.add_argument_group("default KV grant (a spec without kvCache): request, limit and grant")
    rule, said = _default(env, ENV_KV_GRANT, defaults.DEFAULT_KV_GRANT)
    g.add_argument("--default-kv-grant", choices=defaults.KV_GRANT_RULES, default=rule,
                   help="the grant between the request and the limit (max-num-seqs x max-model-len): requests, a "
                        "fair share (the footprint grows to at most 1/--kv-tenants-per-gpu of its GPU's budget); "
                        f"room: vLLM's own, the room left ({said})")
    n, said = _default(env, ENV_KV_REQUESTS, defaults.DEFAULT_KV_GRANT_REQUESTS)
    g.add_argument("--default-kv-requests", type=int, metavar="N", default=n,
                   help=f"the KV request: N requests of the full context, at most max-num-seqs ({said})")
    k, said = _default(env, ENV_KV_TENANTS, defaults.DEFAULT_KV_TENANTS)
    g.add_argument("--kv-tenants-per-gpu", type=int, metavar="K", default=k,
                   help=f"the fair share of the requests rule: 1/K of a GPU's budget ({said})")


def kv_grant_from_args(args: argparse.Namespace) -> memory.KvGrant:
    """--default-kv-grant / --default-kv-requests / --kv-tenants-per-gpu -> the default grant; UserError (one line, exit 2)
    when invalid. A namespace without them (a subcommand that does not take them): the default."""
    try:
        grant = memory.KvGrant(getattr(args, "default_kv_grant", defaults.DEFAULT_KV_GRANT),
                               int(getattr(args, "default_kv_requests", defaults.DEFAULT_KV_GRANT_REQUESTS)),
                               int(getattr(args, "kv_tenants_per_gpu", defaults.DEFAULT_KV_TENANTS)))
    except ValueError as e:  # an environment default argparse does not convert
        raise UserError(f"default KV grant: {e}") from None
    bad = grant.error()
    if bad:
        raise UserError(bad.replace("default KV grant requests", "--default-kv-requests")
                        .replace("KV tenants per GPU", "--kv-tenants-per-gpu"))
    return grant


def add_tenancy_arguments(p: argparse.ArgumentParser,
                          env: Mapping[str, str] | None = None) -> argparse._ArgumentGroup:
    """--pod-security-level, --allow-host-path, --allow-csi-driver: what a podTemplate may reach (chart
    values `tenants.*`). Returns their group (the operator adds its MPS binding flags to it)."""
    g = p.add_argument_group("tenants (docs/webhook.md, \"What a tenant may write\")")
    level, said = _default(env, ENV_POD_SECURITY_LEVEL, validate.DEFAULT_POLICY.level)
    g.add_argument("--pod-security-level", choices=LEVELS, default=level,
                   help=f"the Pod Security level no podTemplate may go beyond ({said})")
    g.add_argument("--allow-host-path", action="append", default=[], metavar="PATH",
                   help="a host path a podTemplate's hostPath volume may mount (it or below it; repeatable; "
                        "default none)")
    g.add_argument("--allow-csi-driver", action="append", default=[], metavar="DRIVER",
                   help="a CSI driver a podTemplate's inline csi volume may use (repeatable; default none)")
    g.add_argument("--allow-hf-endpoint", action="append", default=[], metavar="URL",
                   help="a Hugging Face mirror a spec's HF_ENDPOINT may name (repeatable; default none: the Hub)")
    g.add_argument("--allow-max-logprobs", type=int, default=limits.MAX_LOGPROBS_DEFAULT, metavar="N",
                   help="the largest --max-logprobs a spec's extraArgs may set (default vLLM's own, %(default)s)")
    return g


def tenancy_from_args(args: argparse.Namespace) -> validate.Policy:
    """The tenancy flags -> the one validator's Policy; UserError (one line, exit 2) for a level
    outside LEVELS (an environment default argparse does not check). A namespace without them:
    the default policy."""
    level = getattr(args, "pod_security_level", validate.DEFAULT_POLICY.level)
    if level not in LEVELS:
        raise UserError(f"--pod-security-level {level!r} must be one of {', '.join(LEVELS)}")
    logprobs = getattr(args, "allow_max_logprobs", limits.MAX_LOGPROBS_DEFAULT)
    if not isinstance(logprobs, int) or not 0 <= logprobs <= limits.MAX_LOGPROBS:
        raise UserError(f"--allow-max-logprobs {logprobs!r} must be an integer in 0..{limits.MAX_LOGPROBS}")
    return validate.Policy(level=cast(validate.Level, level), host_paths=tuple(getattr(args, "allow_host_path", ()) or ()),
                           csi_drivers=tuple(getattr(args, "allow_csi_driver", ()) or ()),
                           hf_endpoints=tuple(getattr(args, "allow_hf_endpoint", ()) or ()), max_logprobs=logprobs)
