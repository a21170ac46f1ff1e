"""The inputs' digests a merge report records (``netutility_jax.folders``, where the command's
digests are taken): each adapter file and ``--input-moments`` file is read for its digest once
a run (a merge, then its replay), the digests are the files' own (computed here), and a file
rewritten in place with its size and modification time kept is still noticed."""

from __future__ import annotations

import json
import os
import pathlib
import time

import numpy as np
import pytest
from _reference import folder_digest, run_cli

import netutility_jax as nu
from netutility_jax import cli
from netutility_jax.folders import _digests

pytest.importorskip("safetensors")

NAMES = [f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ("q_proj", "v_proj")]
D_IN, D_OUT = 24, 16  # the shapes of tests/cli's adapters: the compiled kernels are shared


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("digests")
    out = []
    for i, r in enumerate((4, 3, 4)):
        rng = np.random.default_rng(i)
        ad = {
            n: {
                "lora_a": rng.normal(size=(D_IN, r)).astype(np.float32),
                "lora_b": (rng.normal(size=(r, D_OUT)) / 4).astype(np.float32),
                "scale": 2.0,
            }
            for n in NAMES
        }
        p = root / "adapters" / f"task{i}"
        nu.peft.save_adapter(ad, p, base_model_name_or_path="tiny-test-model")
        out.append(str(p))
    return out


SETTLE_NS = 200_000_000  # (_digests._SETTLE_NS here, so that the files settle in a moment)


def _settled_copies(folders, root: pathlib.Path, monkeypatch, extra=()) -> list[str]:
    """Copies of the adapter folders (and the files ``extra``) last modified an hour ago and
    changed over ``SETTLE_NS`` ago: a file written or changed just before it is hashed is hashed
    again each time (``_digests._SETTLE_NS``)."""
    import shutil

    monkeypatch.setattr(_digests, "_SETTLE_NS", SETTLE_NS)
    out = []
    old = time.time() - 3600
    for f in folders:
        dst = root / pathlib.Path(f).name
        shutil.copytree(f, dst)
        for p in dst.iterdir():
            os.utime(p, (old, old))
        out.append(str(dst))
    for p in extra:
        os.utime(p, (old, old))
    time.sleep(1.5 * SETTLE_NS / 1e9)
    return out


def _count_opens(monkeypatch, module, under: list[str]) -> dict[str, int]:
    """Counts ``open`` calls in ``module`` of files under the folders ``under``."""
    import builtins

    counts: dict[str, int] = {}
    roots = tuple(os.path.abspath(u) + os.sep for u in under)

    def counting(file, *a, **k):
        p = os.path.abspath(os.fspath(file)) if isinstance(file, (str, os.PathLike)) else ""
        if p.startswith(roots) or p in [r[:-1] for r in roots]:
            counts[p] = counts.get(p, 0) + 1
        return builtins.open(file, *a, **k)

    monkeypatch.setattr(module, "open", counting, raising=False)
    return counts


def test_a_merge_and_its_replay_hash_each_adapter_file_once(folders, tmp_path, capsys, monkeypatch):
    """The report's digests are taken before the merge and checked after it; each adapter file
    is read for them once per run (a merge, then its replay), and the digests are the files'."""
    copies = _settled_copies(folders, tmp_path, monkeypatch)
    files = sorted(str(p) for c in copies for p in pathlib.Path(c).iterdir())
    assert len(files) == 2 * len(copies)
    counts = _count_opens(monkeypatch, _digests, copies)
    out = tmp_path / "m"
    rc, _, err = run_cli(capsys, "merge", *copies, "--budget", "2", "--no-plots", "--quiet",
                      "--out", str(out))  # fmt: skip
    assert rc == 0, err
    assert counts == dict.fromkeys(files, 1), counts
    rep = json.loads((out / cli.REPORT_NAME).read_text())
    assert [a["sha256"] for a in rep["config"]["adapters"]] == [folder_digest(c) for c in copies]
    counts.clear()
    rc, _, err = run_cli(capsys, "merge", "--config", str(out / cli.REPORT_NAME), "--out",
                      str(tmp_path / "again"), "--quiet")  # fmt: skip
    assert rc == 0, err
    assert counts == dict.fromkeys(files, 1), counts


def test_a_moments_file_is_hashed_once_a_run(folders, tmp_path, capsys, monkeypatch):
    """An --input-moments file's digest is taken once (the merge's read of it is known to be of
    the same file by its identity), and the report records the file's SHA-256."""
    import hashlib

    rng = np.random.default_rng(5)
    x = rng.normal(size=(50, 24))
    mfile = tmp_path / "m0.npz"
    np.savez(mfile, **{n: x.T @ x / 50 for n in NAMES})
    copies = _settled_copies(folders, tmp_path, monkeypatch, extra=[mfile])
    data = mfile.read_bytes()
    opens = _count_opens(monkeypatch, _digests, [str(tmp_path)])
    real = hashlib.sha256
    of_bytes = []

    def sha256(*a, **k):
        if a and bytes(a[0]) == data:
            of_bytes.append(1)
        return real(*a, **k)

    monkeypatch.setattr(hashlib, "sha256", sha256)
    out = tmp_path / "m"
    rc, _, err = run_cli(capsys, "merge", *copies, "--budget", "2", "--no-plots", "--quiet",
                      "--out", str(out), "--input-moments", str(mfile), "none", "none")  # fmt: skip
    assert rc == 0, err
    assert opens.get(str(mfile)) == 1 and not of_bytes, (opens, of_bytes)
    rec = json.loads((out / cli.REPORT_NAME).read_text())["config"]["input-moments"]
    assert rec[0]["sha256"] == real(data).hexdigest()


def test_a_file_rewritten_with_its_size_and_mtime_kept_is_still_noticed(
    folders, tmp_path, monkeypatch
):
    """The digests kept within a run are keyed by the files' identities: a file rewritten in
    place to the same size with its modification time set back (``cp -p``) changes its change
    time, so the digest is taken again (and a merge would refuse the change)."""
    copies = _settled_copies(folders, tmp_path, monkeypatch)
    before = _digests.adapter_digest(copies[0], "x")
    assert _digests.adapter_digest(copies[0], "x") == before == folder_digest(copies[0])
    f = pathlib.Path(copies[0]) / "adapter_config.json"
    st = f.stat()
    text = f.read_text()
    changed = text.replace('"', "'", 1) if "'" not in text else text[::-1]
    assert len(changed) == len(text) and changed != text
    time.sleep(0.05)
    f.write_text(changed)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    after = _digests.adapter_digest(copies[0], "x")
    assert after != before and after == folder_digest(copies[0])
