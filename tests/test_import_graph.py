"""The layers of specjax import one way: no import cycle among first-party modules.

Every `import` / `from ... import` of a `specjax` module counts, function-local ones included
(a function-local import hides a cycle from Python, not from a reader). The check runs on the
source tree (specjax/, models/ -> specjax.models, kernels/ -> specjax.kernels), and a planted
cycle shows it can fail.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"specjax": ROOT / "specjax", "specjax.models": ROOT / "models",
            "specjax.kernels": ROOT / "kernels", "specjax.configs": ROOT / "configs"}


def module_files(packages: dict[str, Path]) -> dict[str, Path]:
    """{dotted module name: file} for every .py file of the packages."""
    modules = {}
    for package, folder in packages.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def imported_names(module: str, path: Path) -> set[str]:
    """Dotted names a module imports (absolute, relative ones resolved), anywhere in it."""
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """{module: first-party modules it imports} (a name resolves to its longest module prefix)."""
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        targets = {resolve(n) for n in imported_names(module, path) if n.startswith("specjax")}
        graph[module] = {t for t in targets if t and t != module and not module.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def test_no_import_cycles():
    found = cycles(import_graph(module_files(PACKAGES)))
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_a_planted_cycle_is_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def f():\n    from specjax.high import g\n    return g\n")
    (package / "high.py").write_text("from specjax.low import f\n")
    (package / "leaf.py").write_text("import specjax.low\n")
    found = cycles(import_graph(module_files({"specjax": package})))
    assert found == [["specjax.high", "specjax.low"]]
