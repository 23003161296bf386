"""The house rule on imports (docs/architecture.md): every module sits on one floor, and imports go down.

Every module under emapg_cli is parsed with `ast` (nothing is imported). Each `import emapg_cli...` /
`from emapg_cli... import` is an edge, at module level or inside a function. The tests fail on
  * an edge from a module to one on a higher floor (module- and function-level edges alike);
  * an import cycle between modules over the module-level edges (what runs at import time), and any new cycle
    once imports inside functions count too (`KNOWN_FUNCTION_LEVEL_CYCLES` lists the ones left);
  * a same-floor import the design forbids (`FORBIDDEN`: evaluation never reaches into train);
  * two packages that import each other, one way and the other (module- or function-level edges, however many
    modules apart: e.g. rewards/qa.py importing agents/protocol.py while agents/ imports rewards/plugin.py);
  * `typer` imported anywhere outside `cli/`.
FLOORS below is the one table of floors; docs/architecture.md describes it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import emapg_cli

PACKAGE = Path(emapg_cli.__file__).resolve().parent

TASK_CODE = "tasks.*.*"  # the modules inside a task's package: one floor above its declaration

# Floor of each top-level name under emapg_cli (a package or a single module); imports go to the same floor or lower.
FLOORS: dict[str, int] = {
    # 0: helpers every floor may use; the built-in tasks' registry and declarations (tasks/__init__.py, tasks/spec.py,
    # tasks/NAME/__init__.py: plain data)
    "emapg_cli": 0, "errors": 0, "paths": 0, "fileio": 0, "estimator_names": 0, "stats": 0, "outputs": 0,
    "hf_quiet": 0, "progress": 0, "http_client": 0, "bounds": 0, "tasks": 0,
    # 1: pure maths (tensors in, tensors out) and answer grading
    "kl": 1, "grpo": 1, "grading": 1,
    # 2: the canonical example schema
    "data": 2,
    # 3: models (loading, dtypes, prompt rendering, tiny test models) and datasets (cards, layouts, loading)
    "models": 3, "datasets": 3,
    # 4: the extension points: environments/agents, rewards, retrievers, engines (they do not import config), and the
    # serving side over the engines (rollout server, OpenAI endpoint, the bounded HTTP server the retriever runs on too)
    "agents": 4, "rewards": 4, "retrieval": 4, "engines": 4, "serve": 4,
    # 5: the run's config (pydantic models, presets); it checks plugin references through rewards.plugin
    "config": 5,
    # 6: the cores of the commands, which read the config and pass settings down; a built-in task's code
    # (tasks/NAME/*.py but its __init__.py: the problems and its prepare step; `TASK_CODE`)
    "train": 6, "evaluation": 6, "ablate": 6, TASK_CODE: 6, "klcheck": 6, "bench": 6, "plots": 6,
    # 7: the command line
    "cli": 7, "__main__": 7,
}

# Same-floor imports the design still forbids: (importer's top-level name, imported top-level name).
FORBIDDEN = {("evaluation", "train")}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, bool, int]]:
    """(imported emapg_cli module, at module level?, line) for every import in the file. `from pkg import
    name` counts as an import of `pkg.name` when that is a module, else of `pkg`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(child, False)  # for annotations only: not run at import time, but still a dependency
            elif isinstance(child, ast.Import):
                out.extend((a.name, top, child.lineno) for a in child.names if a.name.split(".")[0] == "emapg_cli")
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative import
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([child.module] if child.module else []))
                if base.split(".")[0] == "emapg_cli":
                    for a in child.names:
                        full = f"{base}.{a.name}"
                        out.append((full if full in known else base, top, child.lineno))
            else:
                visit(child, top)

    visit(ast.parse(path.read_text(encoding="utf-8")), True)
    return out


def top_name(module: str) -> str:
    parts = module.split(".")
    if parts[1:2] == ["tasks"] and len(parts) > 3:
        return TASK_CODE  # emapg_cli.tasks.toy.prepare; emapg_cli.tasks.toy (its __init__.py) is "tasks"
    return parts[1] if len(parts) > 1 else "emapg_cli"


def edges() -> list[tuple[str, str, bool, int]]:
    mods = modules()
    return [(m, target, top, line) for m, p in mods.items() for target, top, line in imports(m, p, set(mods))]


def test_every_module_has_a_floor():
    missing = sorted({top_name(m) for m in modules()} - set(FLOORS))
    assert not missing, f"give these a floor in FLOORS (and docs/architecture.md): {missing}"


def test_no_import_goes_up_a_floor():
    up = set()
    for src, dst, top, line in edges():
        a, b = top_name(src), top_name(dst)
        if FLOORS[b] > FLOORS[a] or (a, b) in FORBIDDEN:
            where = "" if top else " (inside a function)"
            up.add(f"{src}:{line} imports {dst}{where}: {a} (floor {FLOORS[a]}) -> {b} (floor {FLOORS[b]})")
    assert not up, "imports that go up a floor (or are forbidden):\n" + "\n".join(sorted(up))


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
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
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_find_cycles_finds_a_cycle():
    # a -> b -> c -> a is one component; d -> a hangs off it and is not part of it
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    graph: dict[str, set[str]] = {}
    for src, dst, top, _ in edges():
        if top and dst != src:
            graph.setdefault(src, set()).add(dst)
    assert not find_cycles(graph), f"import cycles (module level): {find_cycles(graph)}"


# Circles closed only by imports inside functions (harmless at import time, still a tangle). Known ones, to go: none.
KNOWN_FUNCTION_LEVEL_CYCLES: list[list[str]] = []


def test_no_new_import_cycle_through_function_imports():
    graph: dict[str, set[str]] = {}
    for src, dst, _, _ in edges():
        if dst != src:
            graph.setdefault(src, set()).add(dst)
    new = [c for c in find_cycles(graph) if c not in KNOWN_FUNCTION_LEVEL_CYCLES]
    assert not new, f"import cycles (counting imports inside functions): {new}"


def mutual_package_imports(pairs: list[tuple[str, str, str]]) -> list[str]:
    """Pairs of top-level packages that import each other, one line each with an example edge per direction.
    `pairs`: (importer package, imported package, "module:line imports module") per edge."""
    seen: dict[tuple[str, str], str] = {}
    for a, b, where in pairs:
        if a != b:
            seen.setdefault((a, b), where)
    return sorted(f"{a} <-> {b}: {seen[(a, b)]}; {seen[(b, a)]}" for a, b in seen if a < b and (b, a) in seen)


def test_mutual_package_imports_are_found():
    # rewards -> agents and agents -> rewards (through other modules) is one pair; a one-way edge is none
    pairs = [("rewards", "agents", "r.qa:1 imports a.protocol"), ("agents", "rewards", "a.env:9 imports r.plugin"),
             ("agents", "grading", "a.protocol:2 imports g.extract"), ("rewards", "rewards", "r.qa:3 imports r.x")]
    assert mutual_package_imports(pairs) == ["agents <-> rewards: a.env:9 imports r.plugin; r.qa:1 imports a.protocol"]
    assert mutual_package_imports(pairs[1:]) == []


def test_no_two_packages_import_each_other():
    pairs = [(top_name(src), top_name(dst), f"{src}:{line} imports {dst}") for src, dst, _, line in edges()]
    both = mutual_package_imports(pairs)
    assert not both, "packages that import each other (move the shared part below both):\n" + "\n".join(both)


def test_only_cli_imports_typer():
    found = []
    for name, path in modules().items():
        if top_name(name) == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{name}:{node.lineno}" for n in names if n.split(".")[0] == "typer"]
    assert not found, f"typer outside cli/: {found}"
