"""netutility_jax._core.io: atomic files and folders, JSON conversion; _linalg's CPU-only LAPACK rules."""

from __future__ import annotations

import enum
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from netutility_jax._core import io as _io
from netutility_jax._core import linalg as _linalg


class _Color(enum.Enum):
    RED = "red"


def test_to_jsonable_is_plain_json():
    x = {
        1: np.float32(1.5),
        "a": jnp.arange(3),
        "nan": float("nan"),
        "arr_nan": np.array([1.0, np.inf]),
        "set": {"b", "a"},
        "enum": _Color.RED,
        "path": pathlib.Path("/x/y"),
        "t": (np.int64(2), True, None),
        "scalar": np.array(3.0),
    }
    got = _io.to_jsonable(x)
    assert got == {
        "1": 1.5, "a": [0, 1, 2], "nan": None, "arr_nan": [1.0, None], "set": ["a", "b"],
        "enum": "red", "path": "/x/y", "t": [2, True, None], "scalar": 3.0,
    }  # fmt: skip
    json.dumps(got, allow_nan=False)


def _leftovers(folder: pathlib.Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


def test_atomic_file_replaces_only_when_complete(tmp_path):
    path = tmp_path / "f.json"
    path.write_text("old")
    with pytest.raises(RuntimeError), _io.atomic_file(path, "w") as f:
        f.write("half")
        raise RuntimeError("killed")
    assert path.read_text() == "old" and _leftovers(tmp_path, {"f.json"}) == []
    with pytest.raises(TypeError):
        _io.write_json(path, {"x": object()})
    assert path.read_text() == "old" and _leftovers(tmp_path, {"f.json"}) == []
    _io.write_json(path, {"x": np.float64("nan")})
    assert json.loads(path.read_text()) == {"x": None}
    want_mode = _io.umask_modes(tmp_path)[0]
    assert path.stat().st_mode & 0o777 == want_mode  # not mkstemp's 0600


def test_atomic_directory(tmp_path):
    out = tmp_path / "out"
    with _io.atomic_directory(out, fn="t") as d:
        (d / "a.txt").write_text("a")
        (d / "sub").mkdir()
        (d / "sub" / "b.txt").write_text("b")
        assert not out.exists()  # nothing visible before the end
    assert (out / "sub" / "b.txt").read_text() == "b"
    file_mode, dir_mode = _io.umask_modes(tmp_path)
    assert (out / "a.txt").stat().st_mode & 0o777 == file_mode
    assert out.stat().st_mode & 0o777 == dir_mode
    # a failure leaves nothing behind; an existing non-empty folder is never replaced
    with pytest.raises(ValueError), _io.atomic_directory(tmp_path / "o2", fn="t") as d:
        (d / "x").write_text("x")
        raise ValueError
    assert _leftovers(tmp_path, {"out"}) == []
    with pytest.raises(FileExistsError, match=r"t: could not move the output into"):
        with _io.atomic_directory(out, fn="t") as d:
            (d / "new").write_text("n")
    assert sorted(p.name for p in out.iterdir()) == ["a.txt", "sub"]
    with _io.atomic_directory(out, fn="t", on_exists="keep") as d:
        (d / "new").write_text("n")
    assert sorted(p.name for p in out.iterdir()) == ["a.txt", "sub"]
    with _io.atomic_directory(out, fn="t", on_exists="replace") as d:
        (d / "new").write_text("n")
    assert sorted(p.name for p in out.iterdir()) == ["new"]
    assert _leftovers(tmp_path, {"out"}) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    with _io.atomic_directory(empty, fn="t", staging=tmp_path / ".stage") as d:
        assert d == tmp_path / ".stage"
        (d / "z").write_text("z")
    assert os.listdir(empty) == ["z"] and _leftovers(tmp_path, {"out", "empty"}) == []


def test_lapack_workaround_only_on_cpu(monkeypatch):
    x, d = jnp.ones(3), jnp.arange(2.0)
    assert _linalg.lapack_serial() == (jax.default_backend() == "cpu")
    chained = jax.make_jaxpr(lambda x, d: _linalg.after(x, d))(x, d)
    assert len(chained.eqns) > 0  # on this CPU machine: a data dependency is added
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert not _linalg.lapack_serial()
    plain = jax.make_jaxpr(lambda x, d: _linalg.after(x, d))(x, d)
    assert len(plain.eqns) == 0
    monkeypatch.setattr(jax, "block_until_ready", lambda t: pytest.fail("blocked on GPU"))
    assert _linalg.settle(x) is x
