"""The package's structure: layers that never reach up, and a visible public surface.

Static checks on the source (``ast``): no import cycle between the package's modules (imports
inside functions included: a lazy import is still a dependency), every module declares its
public names in ``__all__``, the library never imports the command (``netutility_jax.cli``), and
the command's modules never import a layer above their own.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "netutility_jax"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node)
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                while t and t not in mods:  # `from . import x` names a module or an attribute
                    t = t.rpartition(".")[0]
                if t and t != mod and not mod.startswith(t + "."):  # a package's own parents
                    graph[mod].add(t)
    return graph


def test_no_import_cycle_inside_the_package():
    graph = _imports(_modules())
    # a package's __init__ re-exporting its submodules is not a cycle: drop package -> child
    for m in graph:
        graph[m] = {t for t in graph[m] if not t.startswith(m + ".")}
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if seen.get(t) == 1:
                cycle = [*stack[stack.index(t) :], t]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if t not in seen:
                visit(t)
        stack.pop()
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m)


def test_every_module_declares_all():
    missing = []
    for mod, path in _modules().items():
        tree = ast.parse(path.read_text(), str(path))
        names = {
            t.id
            for node in tree.body
            if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Name)
        }
        if "__all__" not in names:
            missing.append(mod)
    assert not missing, f"modules without __all__: {missing}"


# the command (docs/design.md, "Who owns what"), top layer first: each module imports only
# modules of its own layer or below (within a layer, the cycle check above applies)
CLI_LAYERS = [
    ["__main__"],
    ["entry"],
    ["parser"],
    ["merge", "inspect", "convert", "demo"],
    ["distributed"],
    ["load", "output", "config"],
    ["paths", "args", "job"],
    ["common"],
]


def test_the_command_layers_never_reach_up():
    graph = _imports(_modules())
    rank = {f"netutility_jax.cli.{m}": i for i, layer in enumerate(CLI_LAYERS) for m in layer}
    cli = {m for m in graph if m.startswith("netutility_jax.cli.")}
    assert cli == set(rank), f"modules not in CLI_LAYERS: {sorted(cli ^ set(rank))}"
    up = [
        f"{m} -> {t}"
        for m in sorted(rank)
        for t in sorted(graph[m])
        if t in rank and rank[t] < rank[m]
    ]
    assert not up, f"imports that reach up a layer: {up}"


def _is_command(mod: str) -> bool:
    return mod == "netutility_jax.cli" or mod.startswith("netutility_jax.cli.")


def test_the_library_never_imports_the_command():
    """The command is the top layer: no module outside ``netutility_jax.cli`` imports it (the
    distributed supervisor runs it as ``python -m netutility_jax.cli``, a process, not an
    import)."""
    graph = _imports(_modules())
    up = [
        f"{m} -> {t}"
        for m, targets in graph.items()
        if not _is_command(m)
        for t in sorted(targets)
        if _is_command(t)
    ]
    assert not up, f"the library imports the command: {up}"
