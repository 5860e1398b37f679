"""Reading the documents `vllmfit plan` is given: YAML (libyaml's safe loader, with what plan does
not read blanked first, nesting bounded), one document at a time, sorted into Nodes,
VLLMDeployments, ConfigMaps, DRA objects, ignored kinds and one-line errors (`Objects`)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import yaml

from vllmfit.cli.inputs import read_input
from vllmfit.core import limits
from vllmfit.core.spec.api import KIND

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


GROUP_PREFIX = "vllmfit.dev/"
"""apiVersion of vllmfit's own objects: any kind there but VLLMDeployment is an input error, not an
object plan ignores."""

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
    elif str(data.get("apiVersion") or "").startswith(GROUP_PREFIX):  # vllmfit's group: a misspelt kind
        out.errors.append(f"{where}: unknown kind {kind or '(none)'!r} {name} in {data.get('apiVersion')}; "
                          f"vllmfit.dev has one kind, {KIND}")
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
