"""The package's stages as folders: each imports only the stages below it, and the public
modules' flat paths still import as the same module objects."""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

import netutility_jax as nu

ROOT = pathlib.Path(nu.__file__).resolve().parent

#: Each top-level entry of the package and its layer: a module may import its own layer and
#: those below it, never one above (function-level imports included).
LAYERS = [
    ["errors", "_core"],
    ["scoring"],
    ["allocation"],
    ["registry", "operators"],
    ["peft"],
    ["pipeline"],
    ["hub", "checkpoint", "nnx", "plots", "folders", "provenance"],
    ["experiments"],
    ["cli"],
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(mod: str, is_pkg: bool, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        module = ".".join([*base, node.module] if node.module else base)
    else:
        module = node.module or ""
    names = [f"{module}.{a.name}" for a in node.names]
    # `from netutility_jax import registry` imports the module registry; `from .x import y`
    # imports module x whatever y is
    return names if module == "netutility_jax" else [*names, module]


#: ``netutility_jax`` itself and its public names (``from netutility_jax import merge``): the
#: whole public API, as high as the interop modules it imports.
API = "hub"


def _entry(name: str) -> str | None:
    """The package's top-level entry a dotted name lies in (None: outside the package)."""
    parts = name.split(".")
    if parts[0] != "netutility_jax":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in RANK else API


def upward_imports() -> list[str]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        mod = _module_name(path)
        if mod == "netutility_jax":
            continue
        own = _entry(mod)
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(mod, path.name == "__init__.py", node):
                entry = _entry(target)
                if entry is not None and entry != own and RANK[entry] > RANK[own]:
                    out.append(f"{mod}:{node.lineno} imports {target} ({entry} is above {own})")
    return sorted(set(out))


def test_every_top_level_entry_has_a_layer():
    entries = {
        p.stem if p.is_file() else p.name
        for p in ROOT.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    }
    assert entries == set(RANK), f"entries without a layer or gone: {sorted(entries ^ set(RANK))}"


def test_no_stage_imports_one_above_it():
    bad = upward_imports()
    assert not bad, "\n".join(bad)


def test_the_layer_check_sees_an_upward_import(monkeypatch, tmp_path):
    # the same scan over a copy of one stage module with an import of the pipeline added
    src = (ROOT / "scoring" / "utility.py").read_text()
    fake = tmp_path / "netutility_jax" / "scoring"
    fake.mkdir(parents=True)
    (fake / "utility.py").write_text(src + "\nfrom ..pipeline import merging\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path / "netutility_jax")
    assert any("scoring.utility" in line and "pipeline" in line for line in upward_imports())


@pytest.mark.parametrize(("old", "new"), sorted(nu.MODULE_PATHS.items()))
def test_a_flat_public_path_is_the_moved_module(old, new):
    moved = importlib.import_module(f"netutility_jax.{new}")
    assert importlib.import_module(f"netutility_jax.{old}") is moved
    assert sys.modules[f"netutility_jax.{old}"] is moved


def test_flat_paths_import_in_a_fresh_interpreter():
    # `from netutility_jax.streaming import ...` must work as a first import, not only after
    # this test session imported the package
    code = (
        "from netutility_jax.streaming import merge_adapters_streaming\n"
        "from netutility_jax.moments import save_input_moments\n"
        "from netutility_jax.engine.tables import MaskTable\n"
        "import netutility_jax as nu\n"
        "assert merge_adapters_streaming is nu.merge_adapters_streaming\n"
        "assert callable(nu.allocate) and nu.merging.ZeroUpdateWarning\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
