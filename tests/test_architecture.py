"""The package's structure: layers that never reach up, and a visible public surface.

Static checks on the source (``ast``): no import cycle between the package's modules (imports
inside functions included: a lazy import is still a dependency; no exception), every module
declares its public names in ``__all__``, the library never imports the command
(``netutility_jax.cli``), and the command's modules never import a layer above their own. The
experiments use the library's public API only, and their layer rule (a suite imports the harness,
never the reverse, not even inside a function: the harness looks suites up by name in its
registry) is checked on the source and, for what importing a harness module really loads, in a
fresh interpreter.
"""

from __future__ import annotations

import ast
import functools
import importlib
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "netutility_jax"


@functools.cache
def _parsed(path: pathlib.Path) -> ast.Module:
    """A source file's syntax tree, parsed once a session (the checks only read it)."""
    return ast.parse(path.read_text(), str(path))


def _modules() -> dict[str, pathlib.Path]:
    """The package's modules by dotted name (a copy: the listing is read from disk once)."""
    return dict(_module_paths())


@functools.cache
def _module_paths() -> dict[str, pathlib.Path]:
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


def _imports(mods: dict[str, pathlib.Path], *, lazy: bool = True) -> dict[str, set[str]]:
    """Each module's imports of the package's modules (``lazy=False``: only those run at import
    time, i.e. outside function bodies; ``if TYPE_CHECKING:`` blocks count as import time)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = _parsed(path)
        is_pkg = path.name == "__init__.py"
        for node in _walk(tree, lazy=lazy):
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


def _walk(node: ast.AST, *, lazy: bool):
    """``ast.walk``, not entering function bodies unless ``lazy``."""
    for child in ast.iter_child_nodes(node):
        if not lazy and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield child
        yield from _walk(child, lazy=lazy)


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


#: The size rules the house keeps (docs/design.md): a module over this many lines is split, a
#: function over this many lines of code (blank lines, comments and its docstring not counted)
#: is cut into named steps.
MODULE_LINES = 600
FUNCTION_CODE_LINES = 80


def _code_lines(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines of code: its lines, less blank ones, comment-only ones and its
    docstring (nested functions count within it)."""
    skip: set[int] = set()
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        if isinstance(first.value.value, str):
            skip = set(range(first.lineno, first.end_lineno + 1))
    return sum(
        1
        for i in range(node.lineno, node.end_lineno + 1)
        if i not in skip and lines[i - 1].strip() and not lines[i - 1].strip().startswith("#")
    )


def _too_long(mods: dict[str, pathlib.Path]) -> list[str]:
    out = []
    for mod, path in mods.items():
        lines = path.read_text().splitlines()
        if len(lines) > MODULE_LINES:
            out.append(f"{mod}: {len(lines)} lines (at most {MODULE_LINES})")
        for node in ast.walk(_parsed(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _code_lines(lines, node)
                if n > FUNCTION_CODE_LINES:
                    out.append(
                        f"{mod}.{node.name} (line {node.lineno}): {n} lines of code (at most "
                        f"{FUNCTION_CODE_LINES})"
                    )
    return out


def test_no_module_or_function_is_too_long():
    """Every module of the package (the experiments included) within MODULE_LINES lines, every
    function within FUNCTION_CODE_LINES lines of code."""
    assert _too_long(_modules()) == []


def test_the_size_check_counts_code_lines_only(tmp_path):
    """The check flags a long module and a long function, and counts neither a docstring, nor
    blank or comment lines, nor what lies outside the function."""
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_CODE_LINES - 2))
    doc = '    """' + "\n".join(["A docstring."] * 30) + '"""\n'
    # (at the limit: the def line, the body and the return; the docstring, the comment and the
    # blank line not counted)
    ok = f"def f():\n{doc}" + body + "\n    # a comment\n\n    return 0\n"
    long = f"def g():\n{doc}" + body + "\n    y = 1\n    z = y\n    return z\n"
    (tmp_path / "ok.py").write_text(ok)
    (tmp_path / "long.py").write_text(long + "\n" * MODULE_LINES)
    tree = ast.parse(ok)
    assert _code_lines(ok.splitlines(), tree.body[0]) == FUNCTION_CODE_LINES
    got = _too_long({"pkg.ok": tmp_path / "ok.py", "pkg.long": tmp_path / "long.py"})
    assert [g.split(":")[0] for g in got] == ["pkg.long", "pkg.long.g (line 1)"]
    assert f"{FUNCTION_CODE_LINES + 2} lines of code" in got[1]


def test_every_module_declares_all():
    missing = []
    for mod, path in _modules().items():
        tree = _parsed(path)
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


def _private_uses(mods: dict[str, pathlib.Path]) -> list[tuple[str, str, int]]:
    """Every use of another module's underscored name: ``from .x import _y`` and ``x._y`` where
    ``x`` names one of the package's modules; ``(user, "x._y", line)``."""
    out = []
    for mod, path in mods.items():
        tree = _parsed(path)
        is_pkg = path.name == "__init__.py"
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node)
                for a in node.names:
                    full = f"{base}.{a.name}"
                    if full in mods:
                        aliases[a.asname or a.name] = full
                    elif base in mods and a.name.startswith("_") and not a.name.startswith("__"):
                        out.append((mod, f"{base}.{a.name}", node.lineno))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                out.append((mod, f"{aliases[node.value.id]}.{node.attr}", node.lineno))
    return out


def _shares_private(user: str, owner: str) -> bool:
    """A private module's internals are shared within its package (``peft._write`` and
    ``peft._load`` are one implementation split in files), never outside it nor from a public
    module (whose underscored names are its own)."""
    package = owner.rpartition(".")[0]
    # (a package's __init__ is named as the package: netutility_jax.peft uses peft._common)
    return owner.rpartition(".")[2].startswith("_") and package in (user, user.rpartition(".")[0])


def test_no_module_reaches_into_another_modules_private_names():
    """What two modules share has a public name in a module of its own (scoring internals in
    ``_scoring``, a merge's checks in ``_request``, the report in ``_report``), so a module's
    underscored names can change without breaking another."""
    mods = _modules()
    bad = [
        f"{user}:{line} uses {name}"
        for user, name, line in _private_uses(mods)
        if not _shares_private(user, name.rpartition(".")[0])
    ]
    assert not bad, "\n".join(bad)


def test_the_private_name_check_sees_a_reach_across(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("def _x():\n    pass\n")
    (tmp_path / "pkg" / "b.py").write_text("from . import a\nfrom .a import _x\na._x()\n")
    mods = {"pkg.a": tmp_path / "pkg" / "a.py", "pkg.b": tmp_path / "pkg" / "b.py"}
    assert sorted(n for _, n, _ in _private_uses(mods)) == ["pkg.a._x", "pkg.a._x"]
    assert not _shares_private("pkg.b", "pkg.a")
    assert _shares_private("pkg.b", "pkg._a") and not _shares_private("other.b", "pkg._a")
    assert _shares_private("pkg", "pkg._a")  # the package's __init__


# the command (docs/design.md, "Who owns what"), top layer first: each module imports only
# modules of its own layer or below (within a layer, the cycle check above applies)
CLI_LAYERS = [
    ["__main__"],
    ["entry"],
    ["parser"],
    ["merge", "inspect", "convert", "demo"],
    ["distributed"],
    ["load", "output", "config"],
    ["paths", "args", "job", "configfile", "digests", "options", "values"],
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


# ------------------------------------------------------- the experiments use the public API only


def _public_api() -> tuple[frozenset[str], frozenset[str]]:
    """``(names, modules)``: the names of ``netutility_jax``'s ``__all__`` (read from the source)
    with ``__version__``, and the public modules among them (``nu.peft``, ``nu.registry`` ...)
    with ``nu.errors``, the exception types (docs/python.md)."""
    tree = ast.parse((ROOT / "__init__.py").read_text())
    (names,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
    ]
    modules = {
        "checkpoint",
        "errors",
        "experiments",
        "nnx",
        "peft",
        "plots",
        "provenance",
        "registry",
    }
    assert modules - {"errors"} <= set(names), "a public module left netutility_jax.__all__"
    return frozenset({*names, "__version__"}), frozenset(modules)


def _non_public_uses(path: pathlib.Path, mod: str) -> list[str]:
    """Every use in ``path`` (module ``mod``) of the library other than its public API: an
    import of a module that is not public (``netutility_jax.merging``, ``netutility_jax._io``),
    of a name not in ``netutility_jax.__all__``, of an underscored name of a public module, and
    ``nu.<name>`` / ``nu.peft._<name>`` attributes likewise; as ``"file:line: what"``."""
    names, modules = _public_api()
    tree = _parsed(path)
    is_pkg = path.name == "__init__.py"
    where = path.relative_to(ROOT.parent) if path.is_relative_to(ROOT.parent) else path
    bad: list[str] = []
    bound: dict[str, str] = {}  # local name -> "netutility_jax" or "netutility_jax.<public>"

    def check_module(full: str, line: int) -> bool:
        parts = full.split(".")
        if parts[0] != "netutility_jax" or full.startswith(EXP):
            return False
        if len(parts) > 2 or (len(parts) == 2 and parts[1] not in modules):
            bad.append(f"{where}:{line}: imports {full}, not a public module of netutility_jax")
            return False
        return True

    def check_name(base: str, name: str, line: int, how: str) -> None:
        if name.startswith("__") and name.endswith("__"):  # nu.__version__, nu.__file__
            return
        if base == "netutility_jax" and name not in names:
            bad.append(
                f"{where}:{line}: {how} netutility_jax.{name}, not in netutility_jax.__all__"
            )
        elif base != "netutility_jax" and name.startswith("_") and not name.startswith("__"):
            bad.append(f"{where}:{line}: {how} {base}.{name}, a private name")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if check_module(a.name, node.lineno):
                    bound[a.asname or a.name.split(".")[0]] = (
                        a.name if a.asname else "netutility_jax"
                    )
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, is_pkg, node)
            if not check_module(base, node.lineno):
                continue
            for a in node.names:
                check_name(base, a.name, node.lineno, "imports")
                if base == "netutility_jax" and a.name in modules:
                    bound[a.asname or a.name] = f"{base}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            base = bound.get(node.value.id)
            if base is not None:
                check_name(base, node.attr, node.lineno, "uses")
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name)
            and bound.get(node.value.value.id) == "netutility_jax"
            and node.value.attr in modules
        ):
            check_name(f"netutility_jax.{node.value.attr}", node.attr, node.lineno, "uses")
    return bad


def test_the_experiments_use_the_library_s_public_api_only():
    """``netutility_jax.experiments`` is a user of the library like any other: it imports
    ``netutility_jax`` (``nu.merge_adapters``, ``nu.peft.save_adapter``) and its public modules,
    never a private module or name, so that the library's internals can move without breaking
    it (what the experiments need of their own, e.g. atomic result files, is in
    ``experiments.harness.records``)."""
    bad = [
        use
        for mod, path in _modules().items()
        if mod == EXP or mod.startswith(EXP + ".")
        for use in _non_public_uses(path, mod)
    ]
    assert not bad, "the experiments use the library's non-public API:\n" + "\n".join(bad)


def test_the_public_api_check_sees_each_kind_of_reach(tmp_path):
    src = tmp_path / "netutility_jax" / "experiments" / "x.py"
    src.parent.mkdir(parents=True)
    src.write_text(
        "import netutility_jax as nu\n"
        "import netutility_jax._io\n"
        "from netutility_jax import _tree, peft, merge_adapters\n"
        "from .. import _provenance\n"
        "from ..merging import fold\n"
        "from ..errors import InputError, _hidden\n"
        "nu._tree.x, nu.peft._load, nu.merge, nu.__version__, peft._common\n"
    )
    bad = _non_public_uses(src, f"{EXP}.x")
    got = sorted(b.split(": ", 1)[1] for b in bad)
    assert got == sorted([
        "imports netutility_jax._io, not a public module of netutility_jax",
        "imports netutility_jax._tree, not in netutility_jax.__all__",
        "imports netutility_jax._provenance, not in netutility_jax.__all__",
        "imports netutility_jax.merging, not a public module of netutility_jax",
        "imports netutility_jax.errors._hidden, a private name",
        "uses netutility_jax._tree, not in netutility_jax.__all__",
        "uses netutility_jax.peft._load, a private name",
        "uses netutility_jax.peft._common, a private name",
    ]), got  # fmt: skip
    assert all(b.startswith(f"{src}:") for b in bad)


# --------------------------------------------------------------------- the experiments' layers

# docs/design.md ("The experiments' layers"): a suite imports the harness, never the reverse;
# the harness (and with it grid and report) imports no model and no suite when it is imported.
# Every module of netutility_jax.experiments is in exactly one of these lists.
EXP = "netutility_jax.experiments"
HARNESS = [f"harness.{m}" for m in [
    "runner", "grid", "stats", "report", "report_tables", "report_markdown", "report_figures",
    "evaluate", "passes", "fitting", "trainer", "allocations", "suites", "study", "seeds",
    "planting", "records", "jobs", "plants", "planting_report", "planting_markdown",
    "study_report", "report_sections",
]]  # fmt: skip
MODELS = [f"models.{m}" for m in [
    "minilm", "minilm_model", "llama", "llama_config", "llama_load", "llama_model",
    "llama_tokenizer", "gguf_tokenizer", "gguf_io", "clip", "clip_config", "clip_model",
    "clip_load", "clip_image", "sharding",
]]  # fmt: skip
DATA = [f"data.{m}" for m in [
    "tasks", "task_sources", "rdata_reader", "lang_tasks", "nli_data", "nli_tasks",
    "vision_data", "vision_tasks", "vision_images",
]]  # fmt: skip
#: The suite modules that declare a suite (``SPEC``), by the suite's name.
SUITE_MODULES = ("encoder", "language", "language_head", "vision", "nli")
SUITES = [f"suites.{m}" for m in [
    "encoder", "encoder_eval", "train", "language", "lang_eval", "lang_train", "vision",
    "vision_heads", "vision_eval", "vision_adapters", "vision_report", "nli", "nli_toy",
    "nli_report", "nli_head", "nli_head_model", "nli_head_data", "nli_head_eval",
    "nli_head_train", "nli_head_export", "language_head",
]]  # fmt: skip
#: ``netutility demo`` and the studies' own command modules (``python -m``): above the suites
COMMAND = ["demo", "demo_checks", "demo_options", "demo_studies", "planted", "regime_seeds"]
#: The folders (each a layer): their packages import nothing of the package at import time
FOLDERS = ["models", "data", "suites", "harness"]


def test_every_experiments_module_has_a_layer():
    mods = {m[len(EXP) + 1 :] for m in _modules() if m.startswith(EXP + ".")}
    listed = [*HARNESS, *MODELS, *DATA, *SUITES, *COMMAND, *FOLDERS]
    twice = sorted({m for m in listed if listed.count(m) > 1})
    assert not twice, f"modules in two layers: {twice}"
    assert mods == set(listed), (
        f"experiments modules without a layer: {sorted(mods - set(listed))}; listed but "
        f"missing: {sorted(set(listed) - mods)} (tests/test_architecture.py, HARNESS ...)"
    )


def test_the_harness_never_imports_a_model_a_suite_or_the_command():
    """On the source, imports inside functions included: the harness looks a suite up by name
    (``suites.get``); each suite registers itself when its module is imported."""
    graph = _imports(_modules())
    above = {f"{EXP}.{m}" for m in [*MODELS, *SUITES, *COMMAND, "suites"]}
    up = sorted(
        f"{h} -> {t[len(EXP) + 1 :]}" for h in HARNESS for t in graph[f"{EXP}.{h}"] if t in above
    )
    assert not up, f"harness modules import a model, a suite or the command: {up}"


def test_each_builtin_suite_registers_itself_in_one_declaration():
    """Each suite module (``SUITE_MODULES``) declares one ``SPEC`` registered under its own
    name; the command imports every one of them, which registers them."""
    import importlib

    from netutility_jax.experiments.harness import suites

    for name in SUITE_MODULES:
        module = importlib.import_module(f"{EXP}.suites.{name}")
        assert suites.get(name) is module.SPEC, name
    graph = _imports(_modules())
    missing = {f"{EXP}.suites.{n}" for n in SUITE_MODULES} - graph[f"{EXP}.demo"]
    assert not missing, f"netutility demo does not import {sorted(missing)}"


# One fresh interpreter imports the third-party libraries the package is built on (none of the
# package itself), then forks a child per module named on its command line: each child starts
# as a fresh interpreter would as far as netutility_jax goes, records who imported each of the
# package's modules first, and sends the record back (a pipe per child).
_PROBE = """
import importlib, json, os, sys
for lib in ("numpy", "jax", "jax.numpy", "flax", "optax", "safetensors"):
    try:
        importlib.import_module(lib)
    except ImportError:
        pass
assert not any(m.startswith("netutility_jax") for m in sys.modules)
out = {}
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        parent = {}
        class Probe:
            def find_spec(self, mod, path=None, target=None):
                if mod.startswith("netutility_jax") and mod not in parent:
                    f = sys._getframe(1)
                    while f is not None and not f.f_globals.get("__name__", "").startswith(
                        "netutility_jax"
                    ):
                        f = f.f_back
                    parent[mod] = None if f is None else f.f_globals["__name__"]
                return None
        sys.meta_path.insert(0, Probe())
        try:
            importlib.import_module(name)
            rec = {m: parent.get(m) for m in sys.modules if m.startswith("netutility_jax")}
        except BaseException as e:
            rec = {"__error__": repr(e)}
        with os.fdopen(w, "w") as f:
            json.dump(rec, f)
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out[name] = json.loads(f.read() or '{"__error__": "no record"}')
    os.waitpid(pid, 0)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def harness_imports() -> dict[str, dict[str, str | None]]:
    """What importing each harness module loads, module by module (see ``_PROBE``)."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *(f"{EXP}.{n}" for n in HARNESS)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", HARNESS)
def test_importing_a_harness_module_imports_no_model_or_suite(name, harness_imports):
    """What ``import netutility_jax.experiments.<name>`` really loads, as in a fresh interpreter
    (a lazy import at module level, a re-export or a package ``__init__`` would show here)."""
    loaded = harness_imports[f"{EXP}.{name}"]
    assert "__error__" not in loaded, loaded
    banned = {f"{EXP}.{m}" for m in [*MODELS, *SUITES, *COMMAND]}
    bad = sorted(m for m in loaded if m in banned)

    def chain(m):
        seen = [m]
        while loaded.get(seen[-1]) and loaded[seen[-1]] not in seen:
            seen.append(loaded[seen[-1]])
        return " <- ".join(x.rpartition(".")[2] or x for x in seen)

    assert not bad, f"importing {name} imports a model or suite: " + "; ".join(map(chain, bad))


def test_the_documented_python_m_path_runs_once(tmp_path):
    """``python -m netutility_jax.experiments.suites.nli`` (the path .ci/run uses) runs the
    module without a warning (nothing of the package imports it first) and registers it once."""
    out = subprocess.run(
        [sys.executable, "-W", "error", "-m", f"{EXP}.suites.nli", "--help"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--write-toy" in out.stdout


# ------------------------------------------------------------ the tests mirror the package's stages

TESTS = pathlib.Path(__file__).resolve().parent
# each folder of tests/ and the stages of the package whose private modules its tests may use
TEST_STAGES = {
    "core": {"_core"},
    "scoring": {"scoring"},
    "allocation": {"allocation"},
    "operators": {"operators"},
    "pipeline": {"pipeline"},
    "io": {"peft", "folders", "checkpoint", "hub", "nnx", "plots"},
    "cli": {"cli"},
    "experiments": {"experiments"},
}


def _private_reaches(path: pathlib.Path) -> list[tuple[str, int]]:
    """Every dotted path into ``netutility_jax`` that ``path`` names with a private part, as
    (path, line): imports, ``importlib.import_module("...")`` and ``monkeypatch.setattr("...")``
    strings, and attribute chains on a name bound to the package or one of its modules."""
    tree = _parsed(path)
    bound: dict[str, str] = {}
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "netutility_jax":
                    found.append((a.name, node.lineno))
                    bound[a.asname or "netutility_jax"] = a.name if a.asname else "netutility_jax"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("netutility_jax"):
            for a in node.names:
                found.append((f"{node.module}.{a.name}", node.lineno))
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("import_module", "setattr", "delattr")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("netutility_jax")
        ):
            found.append((node.args[0].value, node.lineno))
    for node in ast.walk(tree):  # m = importlib.import_module("netutility_jax.allocate")
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute)
            and node.value.func.attr == "import_module"
            and node.value.args
            and isinstance(node.value.args[0], ast.Constant)
            and str(node.value.args[0].value).startswith("netutility_jax")
        ):
            bound[node.targets[0].id] = node.value.args[0].value
    for node in ast.walk(tree):  # nu._core.tree.collect, _plan.DENSE_BYTES (bound above)
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if chain and isinstance(node, ast.Name) and node.id in bound:
            found.append((".".join([bound[node.id], *reversed(chain)]), node.lineno))
    return [(p, line) for p, line in found if any(_is_private(x) for x in p.split(".")[1:])]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _stage_of(dotted: str) -> str:
    """The stage owning a private path: its first part below the package (``_core`` for
    ``netutility_jax._core.tree``, ``operators`` for ``netutility_jax.operators._plan``)."""
    parts = dotted.split(".")
    if len(parts) < 2:
        return ""
    try:  # a top-level alias module (netutility_jax.allocate is allocation.allocate)
        return importlib.import_module(".".join(parts[:2])).__name__.split(".")[1]
    except ImportError:
        return parts[1]


def test_each_stage_s_tests_reach_only_its_own_private_modules():
    """A test of one stage uses the public API, its own stage's private modules and the private
    core's (``_core``: trees, buckets, linear algebra, devices; every stage is built on it, as
    the stages' own code is), never another stage's: what a test needs of another stage it
    reaches through that stage's public functions, and a test that exercises a stage's
    internals lives in that stage's folder. Tests outside a stage folder (docs, fuzz, layers)
    use the public API and the core only."""
    bad = []
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS)
        if rel.name == "test_architecture.py":  # its sources under test are strings
            continue
        allowed = (
            {"_core"} | TEST_STAGES.get(rel.parts[0], set()) if len(rel.parts) > 1 else {"_core"}
        )
        for dotted, line in _private_reaches(path):
            if _stage_of(dotted) not in allowed:
                bad.append(f"tests/{rel}:{line}: {dotted}")
    assert not bad, "tests reaching into another stage's private modules:\n" + "\n".join(
        sorted(set(bad))
    )


def test_the_test_reach_check_sees_each_form(tmp_path):
    src = (
        "import importlib\n"
        "import netutility_jax as nu\n"
        "from netutility_jax.operators import _plan\n"
        "from netutility_jax.scoring._run import score_run\n"
        "k = importlib.import_module('netutility_jax.scoring._kernels')\n"
        "nu._core.tree.collect\n"
        "nu.pipeline._report.x\n"
        "nu.merge\n"
        "m = importlib.import_module('netutility_jax.allocate')\n"
        "m._bad_counts\n"
        "def f(monkeypatch):\n"
        "    monkeypatch.setattr('netutility_jax.folders._digests._SETTLE_NS', 0)\n"
    )
    (tmp_path / "t.py").write_text(src)
    got = sorted({p for p, _ in _private_reaches(tmp_path / "t.py")})
    assert got == sorted(
        {
            "netutility_jax.operators._plan",
            "netutility_jax.scoring._run.score_run",
            "netutility_jax.scoring._kernels",
            "netutility_jax._core.tree.collect",
            "netutility_jax._core.tree",
            "netutility_jax._core",
            "netutility_jax.pipeline._report.x",
            "netutility_jax.pipeline._report",
            "netutility_jax.folders._digests._SETTLE_NS",
            "netutility_jax.allocate._bad_counts",
        }
    ), got
    got = [_stage_of(p) for p in ("netutility_jax._core.tree", "netutility_jax.allocate._x")]
    assert got == ["_core", "allocation"]
