"""Counts of the house's shape (issue 22), read from the code: ``python tools/house_counts.py``.

- import cycles among shardspeed's modules (every import, those inside functions too: a lazy import hides a
  cycle, it does not remove it; imports under ``if TYPE_CHECKING`` are for annotations and not counted);
- upward imports: a module importing one of a higher layer (:data:`LAYERS`, lowest first; a package's
  layer is its top-level folder's);
- ``._p`` (the engine's private parts) outside shardspeed/runtime/engine.py;
- files over 500 lines and functions over 80 lines;
- files over 400 lines without a one-job docstring: a module that long must say, on the first line of its
  docstring, the one job it does, marked by starting that line with :data:`ONE_JOB` (``One job: ...``);
  a file that does two jobs is split by job instead (issue 38).
- module-level assignments named ``MESH_DIMS`` beyond one (issue 38: one definition, imported everywhere else).
- attributes shardspeed sets on tensors beyond :data:`TENSOR_ATTRS` (torch's own, DeepSpeed's per-parameter
  ``ds_*`` attributes, zero.Init's record of a parameter's slice, the tensor- and expert-parallel flags
  DeepSpeed's code reads): nothing on a tensor points at a unit, a root or an engine (a root finds a
  parameter's unit through a map it owns).
- modules the builder assembles importing ``shardspeed.config`` (annotation-only imports too): the config is
  read once, by the plan; only what sits above the builder and speaks config (:data:`SPEAKS_CONFIG`) may.
- module-level mutable state in shardspeed/ (:func:`module_state`): ``global`` statements, and module-level
  names bound to lists, dicts, sets or other mutable objects. Constants are fine: tuples, frozensets,
  ``MappingProxyType``, compiled regexes, loggers, ``TypeVar``s, frozen dataclass and ``NamedTuple``
  instances, a function's result when it is annotated as one of those. The one holder of the current engine
  (:data:`STATE_ALLOWED`) is allowed by name, and so are DeepSpeed's public constants that DeepSpeed types as
  lists and dicts (:data:`DEEPSPEED_CONSTANTS`).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "shardspeed"


#: shardspeed's layers, lowest first: a module may import its own layer and those below it
LAYERS = [
    {"errors"},
    {"compat"},  # DeepSpeed's names: the deepspeed -> shardspeed import finder and the one-line error
    {"config", "plan", "mesh", "comm", "precision", "optim", "monitor", "profiling", "data", "utils",
     "git_version_info"},
    {"zero", "offload", "parallel", "pipe", "checkpointing", "moe", "ops", "accelerator"},
    {"models"},  # built on the parts (tensor-parallel layers, PipelineModule); no part imports a model
    {"checkpoint", "estimate", "runtime", "autotune"},
    {"integrations", "cli", "bootstrap", "memory_estimate", "launcher", "__init__"},
]


#: DeepSpeed's module paths whose content comes from a higher layer than their folder's (facades: nothing
#: below that layer imports them): the layer of the folder named here
FACADES = {"shardspeed.utils.tensor_fragment": "checkpoint", "shardspeed.utils.zero_to_fp32": "checkpoint",
           "shardspeed.compat.site": "__init__"}


#: What may import shardspeed.config: the config and the plan themselves, what sits above the builder and
#: speaks config (the command line, the integrations that fill "auto", the autotuner that writes configs), and
#: DeepSpeed's mirrored config classes (``deepspeed.runtime.config``, ``.zero.config``, ``.precision_config``)
SPEAKS_CONFIG = ("shardspeed.config", "shardspeed.plan", "shardspeed.cli", "shardspeed.integrations",
                 "shardspeed.autotune", "shardspeed.runtime.config", "shardspeed.runtime.zero.config",
                 "shardspeed.runtime.precision_config")


def _layer(mod: str) -> int:
    parts = mod.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    top = next((folder for name, folder in FACADES.items() if mod == name or mod.startswith(name + ".")), top)
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise KeyError(f"{mod}: its folder {top!r} is in no layer of tools/house_counts.py's LAYERS")


def upward(graph: Dict[str, Set[str]]) -> List[str]:
    return sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs if _layer(b) > _layer(a))


#: the attributes shardspeed may set on a parameter (module-level constants holding these names count by name)
TENSOR_ATTRS = {"data", "grad", "requires_grad", "ds_status", "ds_shape", "ds_numel", "ds_id", "ds_active_sub_modules",
                "INIT_TAG", "TENSOR_PARALLEL_ATTR", "_REPLICA_ATTR", "tp_slice", "sequence_parallel", "allreduce",
                "group_name", "_is_hf_initialized", "COMM_DTYPE_ATTR"}
#: the names shardspeed gives parameters and tensors in its code
TENSOR_NAMES = {"p", "param", "mp", "t", "tensor", "weight", "w"}


def tensor_attributes() -> List[str]:
    """``X.attr = ...`` and ``setattr(X, attr, ...)`` on a tensor-named ``X`` outside :data:`TENSOR_ATTRS`."""
    hits = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in TENSOR_NAMES:
                        name = t.attr
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                    and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in TENSOR_NAMES:
                arg = node.args[1]
                name = arg.value if isinstance(arg, ast.Constant) else ast.unparse(arg)
            if name is not None and name not in TENSOR_ATTRS:
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno} .{name}")
    return hits


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def import_graph(typing_too: bool = False) -> Dict[str, Set[str]]:
    """Every module's imports of shardspeed's modules; ``typing_too``: those under ``if TYPE_CHECKING`` too."""
    files = {_module(p): p for p in PKG.rglob("*.py")}
    graph: Dict[str, Set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        tree = ast.parse(path.read_text())
        typing_only = set() if typing_too else {id(n) for b in tree.body if _is_type_checking(b) for n in ast.walk(b)}
        for node in ast.walk(tree):  # imports inside functions too: a lazy import is still a dependency
            if id(node) in typing_only:
                continue
            targets: List[str] = []
            if isinstance(node, ast.ImportFrom):
                base = _resolve(mod, path.name == "__init__.py", node)
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != mod and t.startswith("shardspeed"):
                    graph[mod].add(t)
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan), excluding a package's own
    ``__init__`` re-exporting its submodules (that is not a cycle of dependencies)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []
    sys.setrecursionlimit(10000)

    def edges(v: str) -> Set[str]:
        return {w for w in graph[v] if not w.startswith(v + ".")}  # a package importing its own submodules

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def config_importers(graph: Dict[str, Set[str]]) -> List[str]:
    """Modules outside :data:`SPEAKS_CONFIG` that import shardspeed.config (or one of its modules)."""
    def under(mod: str, names) -> bool:
        return any(mod == n or mod.startswith(n + ".") for n in names)

    return sorted(f"{a} -> {b}" for a, bs in graph.items() if not under(a, SPEAKS_CONFIG)
                  for b in bs if under(b, ("shardspeed.config",)))


def private_parts() -> List[str]:
    hits = []
    for folder in ("shardspeed", "tests", "benchmarks", "examples"):
        for p in (ROOT / folder).rglob("*.py"):
            if p in (PKG / "runtime" / "engine.py", PKG / "runtime" / "deepspeed_members.py"):
                continue  # the Engine class and its DeepSpeed-members mixin (the same class, two files)
            for i, line in enumerate(p.read_text().splitlines(), 1):
                if "._p." in line or line.rstrip().endswith("._p"):
                    hits.append(f"{p.relative_to(ROOT)}:{i}")
    return hits


def sizes() -> tuple:
    long_files, long_functions = [], []
    for p in PKG.rglob("*.py"):
        text = p.read_text()
        n = len(text.splitlines())
        if n > 500:
            long_files.append(f"{p.relative_to(ROOT)} {n}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > 80:
                    long_functions.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} {length}")
    return long_files, long_functions


#: how the first line of a long module's docstring begins: the one job the module does follows
ONE_JOB = "One job: "
ONE_JOB_LINES = 400  # files longer than this need it


def without_one_job() -> List[str]:
    """Files over :data:`ONE_JOB_LINES` lines whose module docstring does not begin with :data:`ONE_JOB`."""
    hits = []
    for p in sorted(PKG.rglob("*.py")):
        text = p.read_text()
        n = len(text.splitlines())
        if n > ONE_JOB_LINES and not (ast.get_docstring(ast.parse(text)) or "").startswith(ONE_JOB):
            hits.append(f"{p.relative_to(ROOT)} {n}")
    return hits
def mesh_dims_definitions() -> List[str]:
    """Every module-level assignment named ``MESH_DIMS`` in shardspeed after the first (by path): the mesh's
    dimension names have one definition, which every other module imports."""
    hits = []
    for p in sorted(PKG.rglob("*.py")):
        for node in ast.parse(p.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == "MESH_DIMS" for t in targets):
                hits.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    return hits[1:]
#: the one module-level holder of process-wide state: the current engine (shardspeed/mesh/current.py)
STATE_ALLOWED = {("shardspeed/mesh/current.py", "CURRENT")}
#: DeepSpeed's public constants at its module paths, kept with DeepSpeed's types (scripts and integrations
#: compare them to lists and dicts); shardspeed never writes them
DEEPSPEED_CONSTANTS = {("shardspeed/accelerator/real_accelerator.py", "SUPPORTED_ACCELERATOR_LIST"),
                       ("shardspeed/utils/logging.py", "log_levels"),
                       ("shardspeed/launcher/runner.py", "DEEPSPEED_ENVIRONMENT_PATHS"),
                       ("shardspeed/runtime/lr_schedules.py", "VALID_LR_SCHEDULES"),
                       ("shardspeed/git_version_info.py", "installed_ops"),
                       ("shardspeed/git_version_info.py", "compatible_ops"),
                       ("shardspeed/git_version_info.py", "torch_info"),
                       ("shardspeed/ops/op_builder/__init__.py", "ALL_OPS")}
#: module dunders the import system reads (``__all__``: a module's public names; ``__path__``: a package's)
_DUNDERS = {"__all__", "__path__", "__getattr__"}
_MUTABLE_NODES = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
#: calls whose result is immutable (by their last dotted name)
_IMMUTABLE_CALLS = {"frozenset", "tuple", "MappingProxyType", "compile", "getLogger", "TypeVar", "NewType",
                    "namedtuple", "object", "int", "float", "str", "bytes", "bool", "Path", "getenv", "join",
                    "module_getattr", "ParamSpec", "dtype", "device"}
_IMMUTABLE_RETURNS = ("Tuple", "tuple", "FrozenSet", "frozenset", "str", "int", "float", "bool", "bytes",
                      "Callable", "MappingProxyType", "Pattern")


def _immutable_types(tree: ast.Module) -> Set[str]:
    """Names of this module's frozen dataclasses, NamedTuples and Enums, and of its functions annotated to
    return an immutable value."""
    out: Set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            text = " ".join(ast.unparse(d) for d in node.decorator_list + node.bases)
            if "frozen=True" in text or "NamedTuple" in text or "Enum" in text:
                out.add(node.name)
        elif isinstance(node, ast.FunctionDef) and node.returns is not None:
            if ast.unparse(node.returns).split("[")[0].split(".")[-1] in _IMMUTABLE_RETURNS:
                out.add(node.name)
    return out


def _module_statements(body: List[ast.stmt]):
    """The statements run at import: the module's body and the blocks of its if/try/with statements."""
    for node in body:
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            yield from _module_statements(node.body)
            yield from _module_statements(getattr(node, "orelse", []))
            yield from _module_statements(getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                yield from _module_statements(handler.body)
        else:
            yield node


def _is_mutable(value: ast.expr, immutable: Set[str]) -> bool:
    if isinstance(value, _MUTABLE_NODES):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name not in _IMMUTABLE_CALLS and name not in immutable
    return False


def module_state() -> List[str]:
    """Module-level mutable state in shardspeed/: each ``global`` statement and each module-level name bound
    to a mutable value (see the module's docstring)."""
    immutable: Set[str] = set()
    trees = {p: ast.parse(p.read_text()) for p in sorted(PKG.rglob("*.py"))}
    for tree in trees.values():
        immutable |= _immutable_types(tree)
    hits = []
    for path, tree in trees.items():
        rel = str(path.relative_to(ROOT))
        hits += [f"{rel}:{n.lineno} global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
        for node in _module_statements(tree.body):
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            pairs = [(t, value) for t in targets]
            pairs += [pair for t in targets if isinstance(t, ast.Tuple) and isinstance(value, ast.Tuple)
                      for pair in zip(t.elts, value.elts)]  # a, b = [], {}
            names = [t.id for t, v in pairs if isinstance(t, ast.Name) and _is_mutable(v, immutable)]
            if not names:
                continue
            if any(n in _DUNDERS or (rel, n) in STATE_ALLOWED | DEEPSPEED_CONSTANTS for n in names):
                continue
            hits.append(f"{rel}:{node.lineno} {', '.join(names)} = {ast.unparse(value)[:60]}")
    return hits


def _report(title: str, items: List[str]) -> None:
    print(f"{title}: {len(items)}")
    for item in items:
        print("   ", item)


def main() -> int:
    graph = import_graph()
    long_files, long_functions = sizes()
    _report("import cycles", [" <-> ".join(c) for c in cycles(graph)])
    _report("upward imports", upward(graph))
    _report("._p outside runtime/engine.py", private_parts())
    _report("files over 500 lines", long_files)
    _report("functions over 80 lines", long_functions)
    _report("files over 400 lines without a one-job docstring", without_one_job())
    _report("MESH_DIMS definitions beyond one", mesh_dims_definitions())
    _report("attributes set on tensors (beyond DeepSpeed's ds_* and zero.Init's record)", tensor_attributes())
    _report("modules the builder assembles importing shardspeed.config", config_importers(import_graph(True)))
    _report("module-level mutable state", module_state())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
