"""The house rules of DESIGN.md §3, read from the source: no import circles between files or wings, wings
import downwards only, and the forbidden imports stay out (the model never reaches torch.distributed, the
engine never reaches diffusers, planning and request parsing never reach torch). Type-only and
function-level imports count: they are dependencies all the same."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "cosmos3_batch"
SCRIPTS = ROOT / "scripts"

# Top to bottom: a wing may import the wings below it, never one above it or beside it on the same row.
LAYERS = [
    {"__main__"},
    {"cli"},
    {"pipeline"},
    {"config"},
    {"plan"},
    {"parallel"},
    {"engine", "model"},
    {"io"},
    {"requests", "checkpoint"},
    {"startup"},
]
# (modules, what they must not reach, directly or through the package's own imports)
FORBIDDEN = [
    ("cosmos3_batch.model", "torch.distributed"),
    ("cosmos3_batch.engine", "diffusers"),
    ("cosmos3_batch.plan.simulator", "torch"),
    ("cosmos3_batch.plan.schedule", "torch"),
    ("cosmos3_batch.plan.prefill", "torch"),
    ("cosmos3_batch.requests", "torch"),
]
# Inside a wing, its rooms (subpackages) in the same top-to-bottom order; "" stands for the modules that sit
# directly in the package. A module may import its own room and the rooms below it, never one above.
ROOMS = {
    "cosmos3_batch.pipeline": [{"job"}, {"passes"}, {"finish"}, {"kinds"}],
    "cosmos3_batch.pipeline.kinds": [{"transfer"}, {""}, {"step_cache"}],
}
MAX_LINES = 400
MAX_BODY_LINES = 60  # a function's body, its docstring left out; cli/'s typer signatures are no body


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def imports(path: Path) -> Iterator[str]:
    """Every module a file imports, anywhere in it (`from pkg import mod` yields pkg.mod when it is one)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            for alias in node.names:
                yield f"{node.module}.{alias.name}"


def package_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        # Only real modules of ours are edges (not `pkg.SomeClass`); the package face itself is the base.
        graph[name] = {m for m in imports(path) if m in files and m not in (name, "cosmos3_batch")}
    return graph


def external(name: str) -> set[str]:
    return {m for m in imports(PACKAGE_FILES[name]) if not m.startswith("cosmos3_batch")}


PACKAGE_FILES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = package_graph()


def wing(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "cosmos3_batch"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_two_files_import_each_other_even_through_others():
    assert find_cycle(GRAPH) is None


def test_wings_import_downwards_only():
    level = {w: i for i, row in enumerate(LAYERS) for w in row}
    wings = {wing(m) for m in GRAPH} - {"cosmos3_batch"}
    assert wings <= set(level), f"wings missing from LAYERS: {sorted(wings - set(level))}"
    wrong = sorted(
        f"{a} -> {b} ({wing(a)} may not import {wing(b)})"
        for a, targets in GRAPH.items()
        for b in targets
        if wing(a) != wing(b) and wing(a) != "cosmos3_batch" and level[wing(a)] >= level[wing(b)]
    )
    assert wrong == []


def room(module: str, package: str) -> str | None:
    """The room of `package` that `module` lives in ("" for a module directly in it), None if outside it."""
    if not module.startswith(package + "."):
        return None
    rest = module[len(package) + 1 :].split(".")
    return rest[0] if len(rest) > 1 or rest[0] in {r for row in ROOMS[package] for r in row} else ""


def upward_room_imports(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for package, rows in ROOMS.items():
        level = {r: i for i, row in enumerate(rows) for r in row}
        for a, targets in graph.items():
            for b in targets:
                ra, rb = room(a, package), room(b, package)
                if ra is None or rb is None or ra == rb:
                    continue
                assert ra in level and rb in level, f"{package}: rooms missing from ROOMS: {ra!r}, {rb!r}"
                if level[ra] >= level[rb]:
                    above, below = ra or "(flat)", rb or "(flat)"
                    wrong.append(f"{a} -> {b} ({package}: room {above} may not import {below})")
    return sorted(wrong)


def test_rooms_import_downwards_only():
    assert upward_room_imports(GRAPH) == []


def test_the_room_checker_sees_an_upward_import():
    # Guards against a checker that passes everything: a known edge, then the same edge turned upward.
    runner, results = "cosmos3_batch.pipeline.passes.runner", "cosmos3_batch.pipeline.finish.results"
    assert room(runner, "cosmos3_batch.pipeline") == "passes"
    assert room("cosmos3_batch.pipeline.kinds.denoise", "cosmos3_batch.pipeline.kinds") == ""
    assert upward_room_imports({runner: {results}}) == []
    assert upward_room_imports({results: {runner}}) == [
        f"{results} -> {runner} (cosmos3_batch.pipeline: room finish may not import passes)"
    ]
    flat, chain = "cosmos3_batch.pipeline.kinds.denoise", "cosmos3_batch.pipeline.kinds.transfer.chain"
    assert upward_room_imports({flat: {chain}}) == [
        f"{flat} -> {chain} (cosmos3_batch.pipeline.kinds: room (flat) may not import transfer)"
    ]


def test_the_package_face_imports_nothing_of_ours():
    # Every import of any module runs cosmos3_batch/__init__.py first: it must stay a leaf.
    assert not [m for m in imports(PACKAGE / "__init__.py") if m.startswith("cosmos3_batch")]


def reach(module: str) -> set[str]:
    """The package's modules `module` depends on, itself included."""
    seen, todo = set(), [module]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo += GRAPH.get(node, ())
    return seen


@pytest.mark.parametrize(("scope", "banned"), FORBIDDEN, ids=[f"{s}-{b}" for s, b in FORBIDDEN])
def test_forbidden_imports(scope, banned):
    targets = [m for m in GRAPH if m == scope or m.startswith(scope + ".")]
    assert targets, scope
    offenders = sorted(
        f"{m} (via {dep})"
        for m in targets
        for dep in reach(m)
        if any(e == banned or e.startswith(banned + ".") for e in external(dep))
    )
    assert offenders == []


def test_the_checker_sees_what_it_should():
    # Guards against a walker that finds nothing: known edges of the tree are there.
    assert "cosmos3_batch.model.cosmos3" in GRAPH["cosmos3_batch.model.batched"]
    assert "cosmos3_batch.requests.fields" in GRAPH["cosmos3_batch.requests.parse"]
    assert "torch.distributed" in external("cosmos3_batch.parallel.world")
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_modules_and_scripts_stay_small():
    files = [*PACKAGE.rglob("*.py"), *SCRIPTS.rglob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return node.end_lineno - body[0].lineno + 1


def test_functions_stay_short():
    long = {
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}": n
        for path in PACKAGE.rglob("*.py")
        if "cli" not in path.relative_to(PACKAGE).parts
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (n := body_lines(node)) > MAX_BODY_LINES
    }
    assert long == {}
    assert body_lines(ast.parse('def f():\n    """doc"""\n    a = 1\n    return a\n').body[0]) == 2


def test_scripts_import_no_circle():
    # Scripts import their siblings by bare name (each folder is put on sys.path by the script itself).
    graph = {}
    for path in SCRIPTS.rglob("*.py"):
        siblings = {p.stem for p in path.parent.glob("*.py")} - {path.stem}
        graph[str(path.relative_to(ROOT))] = {
            str((path.parent / f"{m.split('.')[0]}.py").relative_to(ROOT))
            for m in imports(path)
            if m.split(".")[0] in siblings
        }
    assert find_cycle(graph) is None
