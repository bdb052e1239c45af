"""The package's layering and size limits, read from the source with ``ast`` (nothing imported).

Layers, bottom to top (docs/design.md, "Layers"): a module may import its own layer and the
layers below it, never one above, lazily (inside a function) or not, under ``TYPE_CHECKING`` or
not; and no group of modules may import each other in a cycle. The test also holds the size
limits: no file in ``fsdp/`` over 1,000 lines (issue 24: files are cut by what they own, not
by a line count), no function over 80; the files and
functions still over them are listed below, and that list is the to-do list: the test fails
when an entry is no longer over its limit, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "fsdp"

# (layer name, module-name prefixes), bottom first. A module belongs to the layer of its longest
# matching prefix; ``__main__`` modules (command-line entry points, never imported by library
# code) belong to the top layer whatever their package.
LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    # Enums, configs, constants, small helpers; the public wrap policies import nothing either.
    ("base", ("fsdp.api", "fsdp._common", "fsdp.wrap")),
    # Collectives (one path for every backend), collective errors, the sharding groups.
    ("comm", ("fsdp._comm",)),
    # FlatParameter, FlatParamHandle and the pure sharding / precision arithmetic.
    ("flat_param", ("fsdp.flat_param",)),
    # Unit state and its lookups, hooks, lazy init, prefetch, mixed precision, summon, clipping.
    ("runtime", ("fsdp.runtime",)),
    # Constructor steps (planning included) and state dicts: siblings, both above runtime.
    ("init/state_dict", ("fsdp.init", "fsdp.state_dict")),
    # The wrapper and the public modules that mirror torch's (comm hooks, grad scaler), and
    # the weight export (built on the runtime and the state-dict gathers).
    (
        "wrapper",
        (
            "fsdp.fully_sharded_data_parallel",
            "fsdp.comm_hooks",
            "fsdp.sharded_grad_scaler",
            "fsdp.checkpoint",
            "fsdp.export",
        ),
    ),
    # Built on the wrapper and re-exported by the package: the memory planner, the torch alias.
    ("tools", ("fsdp.plan", "fsdp.torch_alias")),
    # The package's public names.
    ("package", ("fsdp",)),
    # Command-line entry points (``__main__`` modules, by the rule above). The benchmarks, the
    # planner's validation run and the example trainer are not in the package at all: they live
    # in benchmarks/ and examples/ and import it like any user (test_package_imports_no_tool).
    ("top", ()),
]

# Upward imports that are part of the design, each with its reason. The test fails if one is no
# longer made (remove it here then).
ALLOWED_UPWARD: Dict[Tuple[str, str], str] = {
    # redirect_torch_fsdp() aliases torch's FSDP1 package to the fsdp package object itself, so
    # it imports the package (inside the function, at call time); the package re-exports it.
    ("fsdp.torch_alias", "fsdp"): "the alias needs the whole public package",
}

MAX_FILE_LINES = 1000
MAX_FUNCTION_LINES = 80

# Exceptions to the limits (path -> reason), relative to the repository root. Empty since issue 15's
# phase 2; an entry needs a reason a reviewer accepts, and the test fails once it is within limits.
FILES_OVER_LIMIT: Dict[str, str] = {}
FUNCTIONS_OVER_LIMIT: Dict[str, str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _resolve(name: str, modules: Dict[str, Path]) -> Optional[str]:
    """The fsdp module an import names (``from pkg import mod`` names ``pkg.mod``), else None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, modules: Dict[str, Path]) -> Iterator[Tuple[str, int]]:
    """Yields ``(imported fsdp module, line)`` for every import in ``path``, nested ones too."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, modules)
                if target is not None:
                    yield target, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("fsdp"):
                continue
            for alias in node.names:
                target = _resolve(f"{source}.{alias.name}", modules)
                if target is not None:
                    yield target, node.lineno


def _layer(module: str) -> int:
    if module.endswith(".__main__"):
        return len(LAYERS) - 1
    best, best_len = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best >= 0, f"{module} is in no layer: add it to LAYERS"
    return best


def _graph() -> Dict[str, Set[Tuple[str, int]]]:
    modules = _modules()
    return {
        module: {(t, line) for t, line in _imports(module, path, modules) if t != module}
        for module, path in modules.items()
    }


def test_package_imports_no_tool() -> None:
    """Nothing in ``fsdp/`` imports the repository's tools (``benchmarks``, ``examples``,
    ``tests``): they are not installed with the package."""
    tools = ("benchmarks", "examples", "tests")
    found: List[str] = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            found += [f"{module}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in tools]
    assert found == [], "\n".join(found)


def test_every_module_is_in_a_layer() -> None:
    for module in _modules():
        _layer(module)


def test_no_upward_import() -> None:
    upward: List[str] = []
    used_exceptions: Set[Tuple[str, str]] = set()
    for module, targets in _graph().items():
        for target, line in sorted(targets):
            if _layer(target) <= _layer(module):
                continue
            key = (module, target)
            if key in ALLOWED_UPWARD:
                used_exceptions.add(key)
                continue
            upward.append(
                f"{module}:{line} imports {target} "
                f"({LAYERS[_layer(module)][0]} -> {LAYERS[_layer(target)][0]})"
            )
    assert upward == [], "upward imports:\n" + "\n".join(upward)
    assert used_exceptions == set(ALLOWED_UPWARD), (
        f"ALLOWED_UPWARD entries no longer needed: {set(ALLOWED_UPWARD) - used_exceptions}"
    )


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle() -> None:
    graph: Dict[str, Set[str]] = {}
    for module, targets in _graph().items():
        graph[module] = {
            t for t, _ in targets if (module, t) not in ALLOWED_UPWARD
        }
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle() -> None:
    # The checker itself: a three-module loop and a self-contained pair are both reported.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]


def _functions(path: Path) -> Iterator[Tuple[str, int]]:
    """Yields ``(qualified name, lines)`` for every function and method in ``path``."""

    def walk(node: ast.AST, prefix: str) -> Iterator[Tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                yield name, child.end_lineno - child.lineno + 1  # type: ignore[operator]
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(ast.parse(path.read_text(encoding="utf-8")), "")


def test_file_and_function_sizes() -> None:
    root = PACKAGE_DIR.parent
    long_files: Dict[str, int] = {}
    long_functions: Dict[str, int] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_FILE_LINES:
            long_files[rel] = lines
        for name, length in _functions(path):
            if length > MAX_FUNCTION_LINES:
                long_functions[f"{rel}::{name}"] = length
    new_files = sorted(set(long_files) - set(FILES_OVER_LIMIT))
    new_functions = sorted(set(long_functions) - set(FUNCTIONS_OVER_LIMIT))
    assert new_files == [], (
        f"files over {MAX_FILE_LINES} lines: {[(f, long_files[f]) for f in new_files]}"
    )
    assert new_functions == [], (
        f"functions over {MAX_FUNCTION_LINES} lines: "
        f"{[(f, long_functions[f]) for f in new_functions]}"
    )
    # The to-do list only shrinks: an entry that is now within its limit must be removed.
    done = sorted(set(FILES_OVER_LIMIT) - set(long_files)) + sorted(
        set(FUNCTIONS_OVER_LIMIT) - set(long_functions)
    )
    assert done == [], f"now within the limits, remove from the allow-lists: {done}"
