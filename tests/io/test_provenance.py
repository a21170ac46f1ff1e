"""``nu.provenance``: what a results writer records (versions, commit) and how it writes (JSON
values, atomic files and folders), against expectations computed independently here: a real
temporary git repository, ``importlib.metadata``, and writes that fail part-way."""

from __future__ import annotations

import enum
import importlib.metadata
import json
import os
import pathlib
import platform
import shutil
import stat
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax import provenance as pv

HAVE_GIT = shutil.which("git") is not None


def _git(cwd: pathlib.Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
    }
    done = subprocess.run(
        ["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True, timeout=60
    )
    return done.stdout.strip()


def _names(folder: pathlib.Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ---------------------------------------------------------------------------- versions, commit


def test_versions_are_the_installed_distributions_in_order_and_python():
    want = {}
    for dist in pv.DISTRIBUTIONS:
        try:
            want[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    got = pv.versions()
    assert list(got) == [*want, "python"]
    assert got == {**want, "python": platform.python_version()}
    assert pv.DISTRIBUTIONS[0] == "netutility-jax" and "jax" in got


@pytest.mark.skipif(not HAVE_GIT, reason="git is not installed")
def test_commit_of_a_real_repository(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "pkg" / "a.py").write_text("x = 1\n")
    (repo / "other.txt").write_text("other\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "first")
    head = _git(repo, "rev-parse", "HEAD")
    assert len(head) == 40
    assert pv.commit(repo) == {"head": head, "dirty": False}
    assert pv.commit(repo / "pkg") == {"head": head, "dirty": False}
    # an untracked file does not count; a change to a tracked one does, under the folder only
    (repo / "pkg" / "new.py").write_text("y = 2\n")
    assert pv.commit(repo / "pkg")["dirty"] is False
    (repo / "other.txt").write_text("changed\n")
    assert pv.commit(repo) == {"head": head, "dirty": True}
    assert pv.commit(repo / "pkg") == {"head": head, "dirty": False}
    (repo / "pkg" / "a.py").write_text("x = 3\n")
    assert pv.commit(str(repo / "pkg")) == {"head": head, "dirty": True}
    # a new commit is the new head
    _git(repo, "commit", "-q", "-am", "second")
    second = _git(repo, "rev-parse", "HEAD")
    assert second != head and pv.commit(repo) == {"head": second, "dirty": False}


def test_commit_outside_a_checkout_is_none(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    assert pv.commit(tmp_path) == {"head": None, "dirty": None}
    # no git at all: the same answer, no error
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    assert pv.commit(tmp_path) == {"head": None, "dirty": None}


def test_commit_defaults_to_the_library_s_folder():
    package = pathlib.Path(nu.__file__).resolve().parent
    got = pv.commit()
    assert set(got) == {"head", "dirty"}
    assert got["head"] == pv.commit(package)["head"]
    assert got["head"] is None or len(got["head"]) == 40


def test_the_public_module_is_nu_provenance():
    assert nu.provenance is pv and "provenance" in nu.__all__
    assert set(pv.__all__) == {
        "DISTRIBUTIONS", "atomic_directory", "atomic_file", "commit", "to_jsonable", "versions",
        "write_json",
    }  # fmt: skip


# ---------------------------------------------------------------------------- JSON values


class Colour(enum.Enum):
    RED = "red"
    BLUE = 2


def test_to_jsonable_gives_plain_json_values():
    x = {
        1: np.float32(0.25),
        "arr": np.arange(6, dtype=np.int8).reshape(2, 3),
        "jax": jnp.asarray([1.5, 2.5], jnp.float32),
        "scalar": jnp.asarray(3, jnp.int32),
        "set": {3, 1, 2},
        "mixed": {"b", 1},
        "tuple": (np.bool_(True), None, "s"),
        "enum": [Colour.RED, Colour.BLUE],
        "path": pathlib.Path("a") / "b.json",
        "nan": float("nan"),
        "inf": np.float64(-np.inf),
        "nested": {"deep": [np.array([np.nan, 1.0])]},
        "f64": np.float64(0.5),  # a float subclass: made a plain float too
    }
    got = pv.to_jsonable(x)
    assert got == {
        "1": 0.25,
        "arr": [[0, 1, 2], [3, 4, 5]],
        "jax": [1.5, 2.5],
        "scalar": 3,
        "set": [1, 2, 3],
        "mixed": [1, "b"],  # (int before str: sorted by type name, then value)
        "tuple": [True, None, "s"],
        "enum": ["red", 2],
        "path": str(pathlib.Path("a") / "b.json"),
        "nan": None,
        "inf": None,
        "nested": {"deep": [[None, 1.0]]},
        "f64": 0.5,
    }
    assert type(got["1"]) is float and type(got["arr"][0][0]) is int
    assert type(got["f64"]) is float
    assert type(got["tuple"][0]) is bool
    json.dumps(got, allow_nan=False)  # strict JSON
    other = object()
    assert pv.to_jsonable(other) is other  # json.dumps then names what it cannot encode


# ---------------------------------------------------------------------------- atomic writes


def test_write_json_writes_strict_json_with_a_newline(tmp_path):
    p = tmp_path / "r.json"
    pv.write_json(p, {"b": np.float64(1.5), "a": [float("nan")]}, sort_keys=True)
    text = p.read_text()
    assert text == json.dumps({"a": [None], "b": 1.5}, indent=1, sort_keys=True) + "\n"
    assert _names(tmp_path) == ["r.json"]
    pv.write_json(p, [1, 2], indent=None)
    assert p.read_text() == "[1, 2]\n"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    p = tmp_path / "results.json"
    pv.write_json(p, {"ok": 1})
    before = p.read_bytes()
    with pytest.raises(TypeError):
        pv.write_json(p, {"bad": object()})
    assert p.read_bytes() == before and _names(tmp_path) == ["results.json"]
    with pytest.raises(RuntimeError, match="half-way"):
        with pv.atomic_file(p, "w") as f:
            f.write('{"partial": ')
            raise RuntimeError("half-way")
    assert p.read_bytes() == before and _names(tmp_path) == ["results.json"]
    # a new file that fails is not created at all
    with pytest.raises(RuntimeError):
        with pv.atomic_file(tmp_path / "new.bin") as f:
            f.write(b"\0" * 10)
            raise RuntimeError("stop")
    assert _names(tmp_path) == ["results.json"]


def test_atomic_file_replaces_the_target_with_umask_modes(tmp_path):
    p = tmp_path / "data.bin"
    p.write_bytes(b"old")
    with pv.atomic_file(p) as f:
        f.write(b"new")
    assert p.read_bytes() == b"new" and _names(tmp_path) == ["data.bin"]
    plain = tmp_path / "plain"
    plain.write_bytes(b"")  # what open() gives under this process's umask
    assert stat.S_IMODE(p.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)


def test_atomic_directory_moves_a_whole_folder_or_nothing(tmp_path):
    target = tmp_path / "sub" / "run"
    with pytest.raises(RuntimeError):
        with pv.atomic_directory(target, fn="test") as tmp:
            (tmp / "a.txt").write_text("a")
            raise RuntimeError("fails half-way")
    assert not target.exists() and _names(target.parent) == []
    with pv.atomic_directory(target, fn="test") as tmp:
        (tmp / "a.txt").write_text("a")
        (tmp / "inner").mkdir()
        (tmp / "inner" / "b.txt").write_text("b")
        assert not target.exists()
    assert _names(target) == ["a.txt", "inner"] and (target / "inner" / "b.txt").read_text() == "b"
    assert _names(target.parent) == ["run"]
    plain = tmp_path / "plain"
    plain.mkdir()
    assert stat.S_IMODE(target.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)
    # a folder with something in it: refused naming the caller, kept, or replaced
    with pytest.raises(FileExistsError, match="test: could not move"):
        with pv.atomic_directory(target, fn="test") as tmp:
            (tmp / "c.txt").write_text("c")
    with pv.atomic_directory(target, fn="test", on_exists="keep") as tmp:
        (tmp / "c.txt").write_text("c")
    assert _names(target) == ["a.txt", "inner"] and _names(target.parent) == ["run"]
    with pv.atomic_directory(target, fn="test", on_exists="replace") as tmp:
        (tmp / "c.txt").write_text("c")
    assert _names(target) == ["c.txt"] and _names(target.parent) == ["run"]


def test_the_experiments_write_with_the_public_module():
    from netutility_jax.experiments.harness import records

    for name in records.__all__:
        assert getattr(records, name) is getattr(pv, name), name
