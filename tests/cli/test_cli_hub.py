"""Adapters given as Hugging Face Hub ids (``org/name[@revision]``): resolved through
``huggingface_hub``'s cache (offline, as these tests run), merged and inspected exactly as the
same folders given as paths; the id and commit recorded in the report; a local folder of the
same name wins; missing huggingface_hub and an id not in the cache are one line, exit 2.

The cache is the real layout (``models--org--name/{blobs,refs,snapshots}``, snapshot files
symlinked to content-addressed blobs), checked by huggingface_hub's own ``scan_cache_dir``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import pytest
from test_cli_config import _adapter  # the same small adapters

import netutility_jax as nu
from netutility_jax import cli, hub

pytest.importorskip("safetensors")
huggingface_hub = pytest.importorskip("huggingface_hub")

BASE = {"base_model_name_or_path": "tiny-test-model", "task_type": "CAUSAL_LM"}
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
FLAGS = ["--budget", "3", "--alpha", "1", "--no-plots", "--quiet"]


def _commit(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def _cache_repo(cache: pathlib.Path, repo_id: str, folder: pathlib.Path, commit: str,
                refs: tuple[str, ...] = ("main",)) -> pathlib.Path:  # fmt: skip
    """``folder``'s files as a snapshot of ``repo_id`` at ``commit`` in the Hub cache layout:
    blobs named by their SHA-256, the snapshot's files relative symlinks to them, each ref a
    file holding the commit hash."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(folder.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Three adapter folders and a Hub cache holding them as org/a (main), org/b (refs main and v1, as a tag
    main) and other/c (main)."""
    root = tmp_path_factory.mktemp("hub")
    folders = []
    for i, r in enumerate((4, 3, 4)):
        p = root / "local" / f"task{i}"
        nu.peft.save_adapter(_adapter(i, r), p, base_config=BASE)
        folders.append(p)
    cache = root / "cache"
    commits = {"org/a": _commit("a"), "org/b": _commit("b"), "other/c": _commit("c")}
    _cache_repo(cache, "org/a", folders[0], commits["org/a"])
    _cache_repo(cache, "org/b", folders[1], commits["org/b"], refs=("main", "v1"))
    _cache_repo(cache, "other/c", folders[2], commits["other/c"])
    return {"folders": [str(f) for f in folders], "cache": cache, "commits": commits}


@pytest.fixture
def offline_cache(world, monkeypatch):
    """huggingface_hub pointed at the test cache, offline (HF_HUB_OFFLINE read at call time)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(world["cache"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return world


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _same_adapter(a: pathlib.Path, b: pathlib.Path) -> None:
    for f in ADAPTER_FILES:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_the_cache_layout_is_huggingface_hubs(world):
    """The hand-built cache is what huggingface_hub itself recognises: each repo with its
    commit, refs and both adapter files."""
    info = huggingface_hub.scan_cache_dir(world["cache"])
    assert not info.warnings, info.warnings
    repos = {r.repo_id: r for r in info.repos}
    assert set(repos) == set(world["commits"])
    for repo_id, commit in world["commits"].items():
        (rev,) = repos[repo_id].revisions
        assert rev.commit_hash == commit
        assert {f.file_name for f in rev.files} == set(ADAPTER_FILES)
    assert {str(r) for r in next(iter(repos["org/b"].revisions)).refs} == {"main", "v1"}


def test_parse_id():
    assert hub.parse_id("org/name") == ("org/name", None)
    assert hub.parse_id("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    for text in ("name", "./org/name", "/abs/path", "a/b/c", "org/na--me", "org/name@", "org/-x",
                 "org/name.", "o rg/name", ""):  # fmt: skip
        assert hub.parse_id(text) is None, text


def test_resolve_gives_the_snapshot_and_its_commit(offline_cache):
    w = offline_cache
    got = hub.resolve("org/b@v1")
    assert got.repo_id == "org/b" and got.revision == "v1" and got.commit == w["commits"]["org/b"]
    assert pathlib.Path(got.path).name == got.commit
    for f in ADAPTER_FILES:
        assert (pathlib.Path(got.path) / f).read_bytes() == (
            pathlib.Path(w["folders"][1]) / f
        ).read_bytes()
    assert hub.resolve("org/a").revision == "main"
    assert hub.resolve(f"other/c@{w['commits']['other/c']}").commit == w["commits"]["other/c"]


def test_merge_of_hub_ids_is_the_merge_of_the_folders(offline_cache, tmp_path, capsys):
    """org/a, org/b@v1 and other/c@<commit> merge bit for bit as the three folders; the report
    records each id and the commit it resolved to; the replay of the report reads the same
    snapshots and writes the same files, and so does a replay whose recorded snapshot folder
    is gone (it resolves id@commit)."""
    w = offline_cache
    ids = ["org/a", "org/b@v1", f"other/c@{w['commits']['other/c']}"]
    by_id, by_path = tmp_path / "by_id", tmp_path / "by_path"
    rc, _, err = _run(capsys, "merge", *ids, *FLAGS, "--out", str(by_id))
    assert rc == 0, err
    rc, _, err = _run(capsys, "merge", *w["folders"], *FLAGS, "--out", str(by_path))
    assert rc == 0, err
    _same_adapter(by_id, by_path)
    rep = json.loads((by_id / cli.REPORT_NAME).read_text())
    hubs = [a["hub"] for a in rep["config"]["adapters"]]
    assert hubs == [{"id": r, "commit": w["commits"][r]} for r in ("org/a", "org/b", "other/c")]
    assert [t["name"] for t in rep["tasks"]] == ["a", "b@v1", f"c@{w['commits']['other/c']}"]
    for a, h in zip(rep["config"]["adapters"], hubs, strict=True):
        assert pathlib.Path(a["path"]).name == h["commit"]
    local = json.loads((by_path / cli.REPORT_NAME).read_text())
    assert all("hub" not in a for a in local["config"]["adapters"])
    replay = tmp_path / "replay"
    rc, _, err = _run(capsys, "merge", "--config", str(by_id / cli.REPORT_NAME), "--out",
                      str(replay), "--quiet")  # fmt: skip
    assert rc == 0, err
    _same_adapter(by_id, replay)
    assert json.loads((replay / cli.REPORT_NAME).read_text())["config"] == rep["config"]
    moved = dict(rep["config"], adapters=[
        {**a, "path": str(tmp_path / "gone" / str(i))} for i, a in enumerate(rep["config"]["adapters"])
    ])  # fmt: skip
    (tmp_path / "moved.json").write_text(json.dumps(moved))
    rc, _, err = _run(capsys, "merge", "--config", str(tmp_path / "moved.json"), "--out",
                      str(tmp_path / "replay2"), "--quiet")  # fmt: skip
    assert rc == 0, err
    _same_adapter(by_id, tmp_path / "replay2")


def test_config_adapters_may_be_hub_ids(offline_cache, tmp_path, capsys):
    w = offline_cache
    cfg = tmp_path / "merge.json"
    cfg.write_text(json.dumps({
        "adapters": ["org/a", {"path": "org/b@v1", "weight": 0.5, "name": "bee"}, "other/c"],
        "budget": 3, "alpha": 1, "no-plots": True, "out": "merged",
    }))  # fmt: skip
    rc, _, err = _run(capsys, "merge", "--config", str(cfg), "--quiet", "--in-memory")
    assert rc == 0, err
    by_path = tmp_path / "by_path"
    rc, _, err = _run(capsys, "merge", *w["folders"], *FLAGS, "--weights", "1,0.5,1",
                      "--in-memory", "--out", str(by_path))  # fmt: skip
    assert rc == 0, err
    _same_adapter(tmp_path / "merged", by_path)
    rep = json.loads((tmp_path / "merged" / cli.REPORT_NAME).read_text())
    assert [t["name"] for t in rep["tasks"]] == ["a", "bee", "c"]


def test_a_local_folder_wins_over_a_hub_id(offline_cache, tmp_path, capsys, monkeypatch):
    """``org/a`` names a folder under the working directory: that folder is read, not the
    cache's org/a, and the report records no Hub id for it (org/b, from the cache, has one)."""
    monkeypatch.chdir(tmp_path)
    nu.peft.save_adapter(_adapter(2, 4), tmp_path / "org" / "a", base_config=BASE)
    rc, _, err = _run(capsys, "merge", "org/a", "org/b", "other/c", *FLAGS, "--out", "local")
    assert rc == 0, err
    rep = json.loads((tmp_path / "local" / cli.REPORT_NAME).read_text())
    first, second, _ = rep["config"]["adapters"]
    assert first["path"] == str(tmp_path / "org" / "a") and "hub" not in first
    assert second["hub"] == {"id": "org/b", "commit": offline_cache["commits"]["org/b"]}
    assert [t["name"] for t in rep["tasks"]] == ["a", "b", "c"]


def test_inspect_reads_hub_ids(offline_cache, capsys):
    w = offline_cache
    rc, out, err = _run(capsys, "inspect", "org/a", "org/b@v1", "--json", "--alpha", "1")
    assert rc == 0, err
    by_id = json.loads(out)
    rc, out, err = _run(capsys, "inspect", *w["folders"][:2], "--json", "--alpha", "1")
    assert rc == 0, err
    by_path = json.loads(out)
    assert [t["adapter"] for t in by_id["tasks"]] == ["org/a", "org/b@v1"]
    assert by_id["tasks"][1]["hub"]["commit"] == w["commits"]["org/b"]
    for a, b in zip(by_id["tasks"], by_path["tasks"], strict=True):
        assert a["energy"] == b["energy"] and a["positive_utility"] == b["positive_utility"]
    assert by_id["lam"] == by_path["lam"]


def _one_line_exit_2(rc: int, out: str, err: str, *parts: str) -> None:
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("netutility merge: error: "), err
    for p in parts:
        assert p in err, err


def test_an_id_not_in_the_cache_while_offline_is_one_line(offline_cache, tmp_path, capsys):
    out = tmp_path / "o"
    rc, o, err = _run(capsys, "merge", "org/a", "org/missing", *FLAGS, "--out", str(out))
    _one_line_exit_2(rc, o, err, "ADAPTER_DIR org/missing: not a local folder",
                     "org/missing is not in the cache", "offline")  # fmt: skip
    rc, o, err = _run(capsys, "merge", "org/a", "org/b@v9", *FLAGS, "--out", str(out))
    _one_line_exit_2(rc, o, err, "org/b at revision v9 is not in the cache")
    assert not out.exists() and os.listdir(tmp_path) == []
    rc, o, err = _run(capsys, "inspect", "org/missing")
    assert rc == 2 and o == "" and err.count("\n") == 1, err
    assert err.startswith("netutility inspect: error: ADAPTER_DIR org/missing: not a local"), err


def test_without_huggingface_hub_a_hub_id_is_one_line(world, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # (import fails)
    out = tmp_path / "o"
    rc, o, err = _run(capsys, "merge", world["folders"][0], "org/a", *FLAGS, "--out", str(out))
    _one_line_exit_2(rc, o, err, "ADAPTER_DIR org/a: not a local folder",
                     "pip install huggingface_hub")  # fmt: skip
    assert os.listdir(tmp_path) == []
    # a path that is no Hub id is the usual missing-folder error, whatever is installed
    rc, o, err = _run(capsys, "merge", world["folders"][0], "./nowhere", *FLAGS, "--out", str(out))
    _one_line_exit_2(rc, o, err, "adapter folder ./nowhere does not exist")


@pytest.mark.slow
def test_a_command_with_the_hub_environment_variables(world, tmp_path):
    """The documented way, in a fresh process: HF_HUB_CACHE and HF_HUB_OFFLINE=1 set before
    huggingface_hub is imported; the merge of the ids is the merge of the folders."""
    env = {**os.environ, "HF_HUB_CACHE": str(world["cache"]), "HF_HUB_OFFLINE": "1",
           "NETUTILITY_COMPILE_CACHE": "off"}  # fmt: skip
    out = tmp_path / "by_id"
    proc = subprocess.run(
        [sys.executable, "-m", "netutility_jax.cli", "merge", "org/a", "other/c", *FLAGS,
         "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    ref = tmp_path / "ref"
    assert cli.main(["merge", world["folders"][0], world["folders"][2], *FLAGS, "--out",
                     str(ref)]) == 0  # fmt: skip
    _same_adapter(out, ref)
