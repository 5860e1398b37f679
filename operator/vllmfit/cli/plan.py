"""`vllmfit plan` (offline, from exported or hand-written YAML) and `vllmfit status` (live cluster).

plan: every document is read on its own; a bad one (malformed YAML, an object without a kind, a
node without GPU information, a deployment naming a missing model) becomes one line in
Plan.errors and the rest is still planned; a Kubernetes object of a kind plan does not use (a
PersistentVolumeClaim, a Service) is ignored with a note in Plan.warnings. Exit code: 0 when every
deployment is admitted, 1 when any is not (as `estimate`), 2 for input that cannot be planned
(no GPU node for the deployments). Deployments whose status says Admitted/Running
with status.memory keep those bookings (never moved); all others are decided in creation order.

status: the same pictures from the live cluster's status fields; nothing is decided again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import yaml
from rich.console import Console

from vllmfit.cli import render
from vllmfit.cli.inputs import read_input
from vllmfit.core import limits, memory, placement
from vllmfit.core.errors import UserError, one_line
from vllmfit.core.model import config as modelconfig
from vllmfit.core.model.facts import ModelArch
from vllmfit.core.spec import names
from vllmfit.core.spec.api import GROUP, KIND, PLURAL, VERSION, VLLMDeployment, VLLMDeploymentSpec
from vllmfit.sources import catalog

OUTPUTS = ("table", "json", "html", "svg")
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's safe loader (PyYAML built with libyaml): about ten times faster than the pure-Python one."""
_STR = "tag:yaml.org,2002:str"
_MERGE = "tag:yaml.org,2002:merge"


class _FastLoader(LOADER):  # type: ignore[misc,valid-type]
    """LOADER with PyYAML's implicit-tag resolution for plain scalars, minus the generality
    SafeLoader never uses (path resolvers, wildcard resolvers): libyaml calls `resolve` once per
    scalar, and in a 10 MB export that was the largest cost after libyaml itself."""

    _implicit = LOADER.yaml_implicit_resolvers

    def resolve(self, kind: Any, value: Any, implicit: Any) -> str:
        if kind is yaml.ScalarNode:
            if implicit[0]:
                for tag, regexp in self._implicit.get(value[:1], ()):
                    if regexp.match(value):
                        return tag
            return _STR
        return self.DEFAULT_SEQUENCE_TAG if kind is yaml.SequenceNode else self.DEFAULT_MAPPING_TAG

    def descend_resolver(self, current_node: Any, current_index: Any) -> None:
        pass

    def ascend_resolver(self) -> None:
        pass


# The shortcut holds only while nobody registered path or wildcard resolvers (PyYAML globals).
_LOADER_FAST = _FastLoader if not LOADER.yaml_path_resolvers and None not in LOADER.yaml_implicit_resolvers else LOADER


def blank_unread(text: str) -> str:
    """The text with what vllmfit never reads blanked out, line count kept (so line numbers in
    messages stay right; libyaml skips blank lines without building anything):

    - every block `managedFields:` entry (the API server's field bookkeeping), anywhere;
    - the block `status:` of a Node (addresses, capacity, conditions, container images, node
      info): vllmfit reads a Node's labels and annotations only. The Node is recognised by a
      `kind: Node` line at the same indentation earlier in the same mapping, which is how
      `kubectl get -o yaml` writes it (keys sorted); anything else is left as it is.

    Together these are about two thirds of a `kubectl get nodes,vllmdeployments -A -o yaml`
    export. Only keys alone on their line are blanked, with the lines below them that are
    indented deeper (or are `- ` items at their own indent, kubectl's style)."""
    if "managedFields:" not in text and "kind: Node" not in text:
        return text
    lines = text.split("\n")
    kinds: dict[int, str] = {}  # indentation of a mapping's keys -> its `kind:` value
    skip: int | None = None  # blanking the block of a key at this indentation
    for i, line in enumerate(lines):
        body = line.lstrip(" ")
        if not body:
            continue
        depth = len(line) - len(body)
        if skip is not None:
            if depth > skip or (depth == skip and body.startswith("- ")):
                lines[i] = ""
                continue
            skip = None
        item = body.startswith("- ")
        key_depth, key = (depth + 2, body[2:]) if item else (depth, body)
        for d in [d for d in kinds if d > key_depth or (d == key_depth and item)]:
            del kinds[d]  # left that mapping (a new sequence item starts a new one)
        if key.startswith("kind:"):
            kinds[key_depth] = key[5:].strip()
            continue
        if item:
            continue
        name = key.rstrip()
        if name == "managedFields:" or (name == "status:" and kinds.get(key_depth) == "Node"):
            lines[i] = ""
            skip = depth
    return "\n".join(lines)


def load_yaml(text: str) -> Any:
    """One YAML document, as yaml.load(text, Loader=CSafeLoader) gives it, about twice as fast:
    libyaml composes the node graph, and the Python objects are built here in one pass, strings
    (nearly every scalar of a kubectl export) taken as they are and everything else (numbers,
    booleans, null, timestamps, merge keys) left to PyYAML's SafeConstructor. Anchors and aliases
    give shared objects, as with PyYAML (so an alias bomb costs no memory here)."""
    loader = _LOADER_FAST(text)
    try:
        node = loader.get_single_node()
        return None if node is None else _build(loader, node, {})
    finally:
        loader.dispose()


def _build(loader: Any, node: yaml.Node, memo: dict[int, Any]) -> Any:
    if isinstance(node, yaml.ScalarNode):
        return node.value if node.tag == _STR else loader.construct_object(node, deep=True)
    done = memo.get(id(node))
    if done is not None:
        return done
    if isinstance(node, yaml.SequenceNode):
        items: list[Any] = []
        memo[id(node)] = items
        items.extend(_build(loader, n, memo) for n in node.value)
        return items
    if not isinstance(node, yaml.MappingNode) or any(k.tag == _MERGE for k, _ in node.value):
        return loader.construct_object(node, deep=True)  # merge keys, custom tags: PyYAML's rules
    mapping: dict[Any, Any] = {}
    memo[id(node)] = mapping
    for k, v in node.value:
        key = _build(loader, k, memo)
        try:
            mapping[key] = _build(loader, v, memo)
        except TypeError:  # an unhashable key, as PyYAML reports it
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark, "found unhashable key", k.start_mark
            ) from None
    return mapping


# --- Reading documents -----------------------------------------------------------------------------


@dataclass
class Objects:
    """What a set of YAML files holds, by kind, with where each object came from."""

    nodes: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    deployments: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    configmaps: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    slices: list[dict[str, Any]] = field(default_factory=list)  # resource.k8s.io ResourceSlices
    claims: list[dict[str, Any]] = field(default_factory=list)  # resource.k8s.io ResourceClaims
    errors: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # objects of kinds plan does not use (a note each)


_DOC_SPLIT = re.compile(r"^---[ \t]*(?:#.*)?$", re.MULTILINE)


def split_documents(text: str) -> list[tuple[int, str]]:
    """A multi-document YAML stream split at `---` lines (so one bad document spoils no other):
    (line number of its first line, text), for documents that hold more than comments."""
    out, start, line = [], 0, 1
    for sep in [*_DOC_SPLIT.finditer(text), None]:
        end = sep.start() if sep else len(text)
        doc = text[start:end]
        if any(ln.strip() and not ln.strip().startswith("#") for ln in doc.splitlines()):
            out.append((line, doc))
        if sep:
            line += text.count("\n", start, sep.end())
            start = sep.end()
    return out


_BRACKETS = re.compile(r"[\[\]{}]")


def nesting(text: str) -> int:
    """An upper bound of a YAML document's flow nesting (brackets inside strings count too), read
    before libyaml sees it: its C composer recurses and would crash on [[[[... 30,000 deep."""
    if text.count("[") + text.count("{") <= limits.MAX_NESTING:
        return 0
    depth = top = 0
    for m in _BRACKETS.finditer(text):
        depth = depth + 1 if m.group() in "[{" else max(depth - 1, 0)
        top = max(top, depth)
    return top


def read_objects(sources: Iterable[tuple[str, str]]) -> Objects:
    """(name, text) pairs -> objects. v1 Lists (kubectl get -o yaml) are flattened."""
    out = Objects()
    for name, text in sources:
        for i, (first, doc) in enumerate(split_documents(text), 1):
            where = f"{name} document {i}"
            doc = blank_unread(doc)
            if nesting(doc) > limits.MAX_NESTING:
                out.errors.append(f"{where}: nested more than {limits.MAX_NESTING} levels deep; not read")
                continue
            try:
                data = load_yaml(doc)
            except RecursionError:
                out.errors.append(f"{where}: nested too deeply to read")
                continue
            except yaml.YAMLError as e:
                mark = getattr(e, "problem_mark", None)
                at = f" (line {first + mark.line})" if mark is not None else ""
                out.errors.append(f"{where}: not valid YAML{at}: {getattr(e, 'problem', None) or e}")
                continue
            _collect(out, where, data)
    return out


def _collect(out: Objects, where: str, data: Any) -> None:
    if data is None:
        return
    if not isinstance(data, dict):
        out.errors.append(f"{where}: expected a Kubernetes object (a mapping), got {type(data).__name__}")
        return
    kind = str(data.get("kind") or "")
    items = data.get("items")
    if kind == "List" or (kind.endswith("List") and isinstance(items, list)):
        for j, item in enumerate(items if isinstance(items, list) else []):
            _collect(out, f"{where} item {j + 1}", item)
        return
    meta: dict[str, Any] = data["metadata"] if isinstance(data.get("metadata"), dict) else {}
    name = str(meta.get("name") or "?")
    if kind == "Node":
        out.nodes.append((f"Node {name} ({where})", data))
    elif kind == KIND:
        ns = str(meta.get("namespace") or "default")
        out.deployments.append((f"{KIND} {ns}/{name} ({where})", data))
    elif kind == "ConfigMap":
        out.configmaps[(str(meta.get("namespace") or "default"), name)] = data
    elif kind == "ResourceSlice" and str(data.get("apiVersion")) == "resource.k8s.io/v1":
        out.slices.append(data)
    elif kind == "ResourceClaim" and str(data.get("apiVersion")) == "resource.k8s.io/v1":
        out.claims.append(data)
    elif kind and isinstance(data.get("apiVersion"), str):  # a Kubernetes object plan has no use for
        out.ignored.append(f"{where}: {kind} {name} ignored (plan reads Node, {KIND}, ConfigMap, "
                           "resource.k8s.io/v1 ResourceSlice and ResourceClaim)")
    else:
        out.errors.append(
            f"{where}: unknown kind {kind or '(none)'!r} {name}; expected Node, {KIND}, "
            "ConfigMap, resource.k8s.io/v1 ResourceSlice or ResourceClaim, or a List of them"
        )


def read_files(paths: Iterable[str]) -> list[tuple[str, str]]:
    """(name, text) per -f argument, each read bounded (cli.inputs; '-' is stdin)."""
    return [("<stdin>" if path == "-" else path, read_input(path)) for path in paths]


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
               budget: memory.BudgetPolicy = memory.DEFAULT_POLICY) -> placement.Plan:
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
            nodes.values(), requests, admitted=admitted, admitted_flags=flags, policy=policy
        )
    else:
        plan = placement.plan(nodes.values(), [], admitted=admitted, admitted_flags=flags, policy=policy)
        plan.requests.update({r.key: r for r in requests})
        plan.decisions.update(shown)
    plan.errors = sorted(plan.errors + errors)
    plan.warnings = sorted(set(plan.warnings) | set(notes) | set(objs.ignored))
    return plan


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
    from vllmfit.cli.estimate import budget_from_args

    plan = build_plan(objs, policy=args.policy, budget=budget_from_args(args))
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


# --- status: the live cluster ------------------------------------------------------------------


def load_live(core: Any, custom: Any) -> Objects:
    """Nodes and VLLMDeployments through the official client (or fakes with the same methods)."""
    from kubernetes.client import ApiClient

    api = ApiClient()
    out = Objects()
    for node in core.list_node().items:
        data = node if isinstance(node, dict) else api.sanitize_for_serialization(node)
        out.nodes.append((f"Node {data.get('metadata', {}).get('name', '?')}", data))
    listing = custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)
    for item in listing.get("items", []):
        meta = item.get("metadata") or {}
        out.deployments.append((f"{KIND} {meta.get('namespace', 'default')}/{meta.get('name', '?')}", item))
    return out


def connect(kubeconfig: str | None, context: str | None) -> tuple[Any, Any]:
    """CoreV1Api and CustomObjectsApi from the kubeconfig (in a pod without one: the service account)."""
    from kubernetes import client, config

    try:
        if kubeconfig or context or not os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_kube_config(config_file=kubeconfig, context=context)
        else:
            config.load_incluster_config()
    except (config.ConfigException, OSError, ValueError, TypeError) as e:
        raise UserError(f"cannot load the kubeconfig: {one_line(e)}") from None
    return client.CoreV1Api(), client.CustomObjectsApi()


def api_words(e: BaseException) -> str:
    """An API server's refusal as a sentence (the client's own text starts "(404)\nReason: ...")."""
    status = getattr(e, "status", None)
    if not isinstance(status, int):
        return one_line(e)
    if status == 404:
        return (f"{KIND} is not installed in this cluster (no CustomResourceDefinition {PLURAL}.{GROUP}); "
                "install vllmfit with `helm install vllmfit charts/vllmfit`, or its CRDs with "
                "`kubectl apply --server-side -f crds/`")
    if status == 403:
        return f"the API server says this kubeconfig's user may not list Nodes or {KIND}s (403 Forbidden)"
    if status == 401:
        return "the API server did not accept this kubeconfig's credentials (401 Unauthorized)"
    return f"the API server answered {status} {getattr(e, 'reason', '') or ''}".rstrip()


def run_status(args: argparse.Namespace, core: Any = None, custom: Any = None) -> int:
    from kubernetes.client.exceptions import OpenApiException
    from urllib3.exceptions import HTTPError

    if core is None or custom is None:
        core, custom = connect(args.kubeconfig, args.context)
    try:
        objs = load_live(core, custom)
    except (OpenApiException, HTTPError, OSError, ValueError) as e:  # API errors, no connection
        raise UserError(f"cannot read the cluster: {api_words(e)}") from None
    plan = build_plan(objs, decide=False)
    emit(plan, args.output, args.out_file, "vllmfit status")
    return 0


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
    _output_args(p)
    p.add_argument(
        "--policy",
        choices=("vllm", "adr"),
        default="vllm",
        help="memory model: vllm (what vLLM does, default) or adr (ADR-0002 formulas)",
    )
    from vllmfit.cli.estimate import add_budget_args

    add_budget_args(p)  # the cluster-wide budget policy; node labels still override it per node pool
    p.set_defaults(func=run_plan)
    s = subparsers.add_parser(
        "status",
        help="show the live cluster's GPU ledger",
        description="Read nodes and VLLMDeployments through the kubeconfig and draw the GPU ledger from "
        "the operator's status fields (nothing is decided again).",
    )
    s.add_argument(
        "--kubeconfig", metavar="FILE", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)"
    )
    s.add_argument("--context", help="kubeconfig context")
    _output_args(s)
    s.set_defaults(func=run_status)


def _output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o",
        "--output",
        choices=OUTPUTS,
        default="table",
        help="output format, as in kubectl: table (terminal), json (the plan as data), html (self-contained "
        "report), svg (bars)",
    )
    p.add_argument("--out-file", metavar="FILE", help="write to FILE instead of stdout")
