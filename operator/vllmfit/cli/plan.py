"""`vllmfit plan` (offline, from exported or hand-written YAML; the documents are read by `documents`).

plan: every document is read on its own; a bad one (malformed YAML, an object without a kind, a
node without GPU information, a deployment naming a missing model) becomes one line in
Plan.errors and the rest is still planned; a Kubernetes object of a kind plan does not use (a
PersistentVolumeClaim, a Service) is ignored with a note in Plan.warnings. Exit code: 0 when every
deployment is admitted, 1 when any is not (as `estimate`), 2 for input that cannot be planned
(no GPU node for the deployments). Deployments whose status says Admitted/Running
with status.memory keep those bookings (never moved); all others are decided in creation order.

`vllmfit status` (the `status` module) draws the same pictures from the live cluster's status fields.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from rich.console import Console

from vllmfit.cli import render
from vllmfit.cli.documents import Objects, read_files, read_objects
from vllmfit.core import memory, placement
from vllmfit.core.errors import UserError, one_line
from vllmfit.core.model import config as modelconfig
from vllmfit.core.model.facts import ModelArch
from vllmfit.core.spec import names
from vllmfit.core.spec.api import KIND, VLLMDeployment, VLLMDeploymentSpec
from vllmfit.sources import catalog

OUTPUTS = ("table", "json", "html", "svg")


# --- Models ------------------------------------------------------------------------------------


def resolve_model(
    spec: VLLMDeploymentSpec,
    namespace: str = "default",
    configmaps: Mapping[tuple[str, str], Mapping[str, Any]] | None = None,
) -> ModelArch:
    """The model facts of a spec: inline modelConfig, a modelConfigRef found among the input's
    ConfigMaps, or the catalog, or the Hugging Face Hub for an "org/name" it does not know."""
    if spec.model_config_inline is not None:
        return modelconfig.parse_hf_config(
            spec.model_config_inline,
            name=spec.model,
            params=spec.model_params,
            params_source="spec.modelParams" if spec.model_params else "computed",
        )
    if spec.model_config_ref is not None:
        ref = spec.model_config_ref
        cm = (configmaps or {}).get((namespace, ref.name))
        if cm is None:
            raise UserError(f"modelConfigRef: ConfigMap {namespace}/{ref.name} is not in the input")
        raw = (cm.get("data") or {}).get(ref.key)
        if raw is None:
            raise UserError(f"modelConfigRef: ConfigMap {namespace}/{ref.name} has no key {ref.key!r}")
        try:
            config = json.loads(raw)
        except json.JSONDecodeError as e:
            raise UserError(f"modelConfigRef: {namespace}/{ref.name} {ref.key} is not JSON: {e}") from None
        return modelconfig.parse_hf_config(
            config,
            name=spec.model,
            params=spec.model_params,
            params_source="spec.modelParams" if spec.model_params else "computed",
        )
    from vllmfit.cli.estimate import resolve_model as by_name  # the catalog, then the Hugging Face Hub

    return by_name(spec.model)


# --- Building the plan -----------------------------------------------------------------------------


def build_plan(objs: Objects, *, policy: memory.Policy = "vllm", decide: bool = True,
               budget: memory.BudgetPolicy = memory.DEFAULT_POLICY,
               kv_grant: memory.KvGrant = memory.DEFAULT_KV_GRANT) -> placement.Plan:
    """Nodes and deployments -> a Plan. decide=False (status): only what the statuses say."""
    errors = list(objs.errors)
    deployments: dict[str, VLLMDeployment] = {}
    places: dict[str, str] = {}  # key -> "VLLMDeployment ns/name (file document N)"
    for where, data in objs.deployments:
        try:
            dep = VLLMDeployment.model_validate(data)
        except ValueError as e:
            try:  # a status out of bounds (negative bytes...) is not restored; the spec is decided again
                dep = VLLMDeployment.model_validate({k: v for k, v in data.items() if k != "status"})
            except ValueError:
                errors.append(f"{where}: {one_line(e)}")
                continue
            errors.append(f"{where}: status not restored ({one_line(e)}); decided again")
        if dep.key in deployments:
            errors.append(f"{where}: duplicate of an earlier {KIND} {dep.key}; ignored")
            continue
        bad_name = names.deployment_name_problem(dep.metadata.name)
        if bad_name:  # the operator would reject it (its Service and Deployments need the name)
            errors.append(f"{where}: {bad_name}")
            continue
        deployments[dep.key] = dep
        places[dep.key] = where
    pods = {uid: key for key, dep in deployments.items() if dep.status for uid in dep.status.pod_uids}
    nodes: dict[str, placement.NodeInfo] = {}
    for where, data in objs.nodes:
        read = placement.read_node(data, catalog.gpu_for_label, pods, policy=budget)
        if read.problem:
            errors.append(f"{where}: {read.problem}" + ("; using its GFD labels" if read.info else ""))
        if read.info is None:
            continue  # a CPU-only node (no GPU labels, no inventory) is no error
        node = read.info
        if node.name in nodes:
            errors.append(f"{where}: duplicate node; ignored")
            continue
        nodes[node.name] = node
    admitted: dict[str, list[placement.Booking]] = {}
    flags: dict[str, memory.Flags] = {}
    requests: list[placement.Request] = []
    shown: dict[str, placement.Decision] = {}
    for key, dep in sorted(deployments.items()):
        st = dep.status
        if st and st.phase in ("Admitted", "Running") and st.memory:
            admitted[key] = placement.bookings_from_status(key, st)
            if st.flags:
                flags[key] = memory.Flags(
                    st.flags.max_model_len,
                    st.flags.max_num_seqs,
                    st.flags.gpu_memory_utilization,
                    st.flags.kv_cache_memory_bytes,
                    st.flags.max_num_batched_tokens,
                )
        elif not decide:
            phase = st.phase if st else "Pending"
            shown[key] = placement.Decision(
                key,
                cast(placement.DecisionPhase, phase),
                reasons=tuple(st.reasons if st else ()),
                suggestions=tuple(st.suggestions if st else ()),
                warnings=tuple(st.warnings if st else ()),
                message=phase,
            )
        try:
            model = resolve_model(dep.spec, dep.metadata.namespace, objs.configmaps)
        except (UserError, ValueError, LookupError) as e:
            if key not in admitted:
                errors.append(f"{places[key]}: {one_line(e)}")
                shown.pop(key, None)
            continue
        requests.append(placement.request_from_object(dep, model))
    notes = _dra_nodes(objs, nodes, admitted)
    if decide:
        plan = placement.plan(
            nodes.values(), requests, admitted=admitted, admitted_flags=flags, policy=policy, kv_grant=kv_grant
        )
    else:
        plan = placement.plan(nodes.values(), [], admitted=admitted, admitted_flags=flags, policy=policy)
        plan.requests.update({r.key: r for r in requests})
        plan.decisions.update(shown)
    _show_grants(plan, deployments)
    plan.errors = sorted(plan.errors + errors)
    plan.warnings = sorted(set(plan.warnings) | set(notes) | set(objs.ignored))
    return plan


def _show_grants(plan: placement.Plan, deployments: Mapping[str, VLLMDeployment]) -> None:
    """A deployment kept from its status shows the KV grant the status names (status.kvCache)."""
    for key, d in plan.decisions.items():
        st = deployments[key].status if key in deployments else None
        kv = st.kv_cache if st else None
        if d.restored and d.replicas and kv is not None and kv.granted_by:
            z = replace(d.replicas[0].sizing, granted_tokens=kv.tokens, grant=kv.granted_by)
            plan.decisions[key] = replace(d, replicas=(replace(d.replicas[0], sizing=z), *d.replicas[1:]))


def _dra_nodes(objs: Objects, nodes: dict[str, placement.NodeInfo],
               admitted: Mapping[str, list[placement.Booking]]) -> list[str]:
    """Nodes whose GPUs ResourceSlices publish with shareable memory: their GPUs (and UUIDs) from
    the slices, and the memory every allocated ResourceClaim vllmfit did not make consumes there
    as foreign use (vllmfit.backends.dra). Returns one line per such claim."""
    if not objs.slices:
        return []
    from vllmfit.backends import dra

    drivers = sorted({str((s.get("spec") or {}).get("driver")) for s in objs.slices})
    devices = dra.devices_from_slices(objs.slices, drivers)
    uses = dra.consumption(objs.claims, {d.key: d for devs in devices.values() for d in devs})
    booked: dict[tuple[str, int], int] = {}
    for bookings in admitted.values():
        for b in bookings:
            booked[(b.node, b.index)] = booked.get((b.node, b.index), 0) + b.footprint.total
    notes = []
    for name, devs in sorted(devices.items()):
        if dra.backend_for("auto", devs) != "dra":
            continue
        known = nodes.get(name)
        agent = known if known and any(s.uuid for s in known.gpus) else None
        mine = [u for u in uses if u.device[:2] in {d.key[:2] for d in devs}]
        nodes[name] = dra.node_from_dra(name, known.labels if known else {}, devs, mine, catalog.gpu_for_label,
                                        booked=booked, agent=agent)
        notes += [f"{name} GPU {i}: {memory.fmt_gib(n)} claimed by ResourceClaim {claim} (foreign use)"
                  for i, claim, n in dra.foreign_claims(name, devs, mine, agent)]
    return notes


def emit(plan: placement.Plan, output: str, out_file: str | None, title: str) -> None:
    """Write the plan as a table (rich), JSON, HTML or SVG to stdout or a file."""
    if output == "table":
        if out_file:
            with open(out_file, "w", encoding="utf-8") as f:
                render.print_plan(Console(file=f, width=160, color_system=None), plan)
        else:
            render.print_plan(Console(), plan)
        return
    text = {
        "json": lambda: placement.to_json(plan) + "\n",
        "html": lambda: render.plan_html(plan, title),
        "svg": lambda: render.plan_svg(plan, title),
    }[output]()
    if out_file:
        try:
            Path(out_file).write_text(text, encoding="utf-8")
        except OSError as e:
            raise UserError(f"cannot write {out_file}: {e.strerror or e}") from None
    else:
        sys.stdout.write(text)


def run_plan(args: argparse.Namespace) -> int:
    objs = read_objects(read_files(args.filename))
    from vllmfit.cli.estimate import budget_from_args, kv_grant_from_args

    plan = build_plan(objs, policy=args.policy, budget=budget_from_args(args), kv_grant=kv_grant_from_args(args))
    if not plan.ledger.nodes and not plan.decisions:
        detail = f": {plan.errors[0]}" if plan.errors else ""
        raise UserError(f"nothing to plan: no usable Node or {KIND} in the input{detail}")
    if not plan.ledger.nodes:
        detail = f" ({plan.errors[0]})" if plan.errors else ""
        raise UserError(f"no GPU node in the input to place {len(plan.decisions)} {KIND}(s) on{detail}; add the "
                        "cluster's nodes: -f nodes.yaml (kubectl get nodes -o yaml), e.g. -f examples/cluster.yaml")
    emit(plan, args.output, args.out_file, "vllmfit plan: " + ", ".join(args.filename))
    # like `estimate`: 1 when anything does not fit (a deployment refused, or a replica left unplaced)
    return 0 if all(d.admitted for d in plan.decisions.values()) else 1


# --- argparse ------------------------------------------------------------------------------------


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="plan deployments onto the GPUs of a cluster file",
        description="Place every VLLMDeployment of the input onto the GPUs of its nodes and show, per GPU, "
        "what each deployment takes, which fit where with which flags, and why the others do not.",
    )
    p.add_argument(
        "-f",
        "--filename",
        action="append",
        required=True,
        metavar="FILE",
        help="YAML with Nodes and VLLMDeployments (kubectl get nodes,vllmdeployments -A -o yaml), and "
        "on DRA clusters ResourceSlices and ResourceClaims (kubectl get resourceslices,resourceclaims -A -o yaml); "
        "repeatable; - reads stdin",
    )
    output_args(p)
    p.add_argument(
        "--policy",
        choices=("vllm", "adr"),
        default="vllm",
        help="memory model: vllm (what vLLM does, default) or adr (ADR-0002 formulas)",
    )
    from vllmfit.cli.estimate import add_budget_args, add_kv_grant_args

    add_budget_args(p)  # the cluster-wide budget policy; node labels still override it per node pool
    add_kv_grant_args(p)  # the cluster's default KV grant (the operator's --default-kv-grant)
    p.set_defaults(func=run_plan)


def output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o",
        "--output",
        choices=OUTPUTS,
        default="table",
        help="output format, as in kubectl: table (terminal), json (the plan as data), html (self-contained "
        "report), svg (bars)",
    )
    p.add_argument("--out-file", metavar="FILE", help="write to FILE instead of stdout")
