"""Imports point one way: no module of handler/ imports, at any depth and from anywhere in its code (function
bodies included), a module that imports it back; schema/, which the front and the handler share, imports none of
the packages above it."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ABOVE_SCHEMA = ("handler", "front", "engine", "models", "kernels", "torch")


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module a file imports, by absolute dotted name (relative imports resolved within `package`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package if node.level else ""
            module = ".".join(filter(None, [base, node.module]))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # `from handler import chat`
    return found


def package_graph(package: str) -> dict[str, set[str]]:
    modules = {f"{package}.{path.stem}": path for path in (ROOT / package).glob("*.py") if path.stem != "__init__"}
    return {name: imported_modules(path, package) & modules.keys() for name, path in modules.items()}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph, as the modules along it, or None."""
    state = {}  # module -> "open" while on the walk's path, "done" once all it reaches is walked

    def walk(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (found := walk(target, path + [target])):
                return found
        state[module] = "done"
        return None

    return next((found for module in sorted(graph) if module not in state and (found := walk(module, [module]))),
                None)


def test_handler_imports_form_no_cycle():
    graph = package_graph("handler")
    assert {"handler.chat", "handler.tools", "handler.output_plan"} <= graph.keys()
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_schema_imports_nothing_above_it():
    for path in (ROOT / "schema").glob("*.py"):
        above = {name for name in imported_modules(path, "schema") if name.split(".")[0] in ABOVE_SCHEMA}
        assert not above, f"{path.name} imports {sorted(above)}"
