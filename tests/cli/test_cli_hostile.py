"""The third hostile-input campaign's findings on the command line's files and messages (issue 46):
config files read by a bounded, strict loader (alias bombs, ``/dev/zero``, duplicate keys, deep
nesting, huge integers), a config that looks like a report, replays that notice changed inputs
(adapters' digests, the library version; ``--allow-changed``), unreadable ``--input-moments``
archives, numeric flags refused by their flag name (``--weights``, ``--alpha``, ``--lam``), a
leading negative in ``--weights``, Hub ids with an empty revision, the library's own errors from
``nu.checkpoint`` and ``nu.peft.save_adapter``, and ``netutility demo`` onto existing results.

Every refusal is one line on stderr naming the file, key and line or the flag, exit code 2.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import time
import tracemalloc

import numpy as np
import pytest
from _reference import folder_digest
from _reference import run_cli as _run
from test_cli_config import BASE, NAMES, RANKS, _adapter

import netutility_jax as nu
from netutility_jax import cli
from netutility_jax.cli import config, configfile
from netutility_jax.errors import FileAccessError, InputError, MissingFileError, NetUtilityError

pytest.importorskip("safetensors")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("hostile")
    out = []
    for i, r in enumerate(RANKS):
        p = root / "adapters" / f"task{i}"
        nu.peft.save_adapter(_adapter(i, r), p, base_config=BASE)
        out.append(str(p))
    return out


def _refused(capsys, argv, message: str, start: str = "netutility merge: error: ") -> str:
    """Run ``argv``: exit 2, nothing on stdout, one line on stderr starting with ``start`` and
    holding ``message``; returns that line."""
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and out == "" and err.count("\n") == 1, (rc, out, err)
    assert err.startswith(start) and message in err, err
    return err


def _line_of(text: str, needle: str, nth: int = 1) -> int:
    """The 1-based line of the ``nth`` occurrence of ``needle`` in ``text`` (found here, not by
    the loader)."""
    pos = -1
    for _ in range(nth):
        pos = text.index(needle, pos + 1)
    return text.count("\n", 0, pos) + 1


# ------------------------------------------------------------------------------ bounded loader


def _bomb(key: str, levels: int = 9) -> str:
    """A "billion laughs" YAML: ``levels`` anchors of 9 aliases each, the last under ``key``;
    9**levels values once expanded."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    lines.append(f"{key}: [" + ", ".join([f"*l{levels - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("key", ["method", "weights", "serving-ranks", "input-moments"])
def test_a_yaml_alias_bomb_is_refused_in_one_line_within_a_second(tmp_path, capsys, key):
    """9**10 values from a 600-byte file: refused while it is read, within a second and a few
    MB (measured on the loader alone), naming the file and the line where the count passed the
    limit; the same bomb under an adapter's weight."""
    pytest.importorskip("yaml")
    text = _bomb(key)
    assert 9**10 > configfile.MAX_NODES  # (so the limit must bind)
    f = tmp_path / "bomb.yaml"
    f.write_text(text)
    tracemalloc.start()
    t0 = time.process_time()  # (CPU time: other processes on a busy machine do not count)
    with pytest.raises(cli.UsageError) as e:
        configfile.read_config(str(f))
    seconds = time.process_time() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert seconds < 1.0 and peak < 8 * 2**20, (seconds, peak)
    msg = str(e.value)
    assert msg.startswith(f"--config {f}: line ") and "aliases are expanded" in msg
    # the line where the count passes the limit, counted here: the top mapping, then per line a
    # key and its list (line 1: 9 strings; line i: 9 copies of line i - 1's list)
    total, size, line = 1, 0, 0
    while total <= configfile.MAX_NODES:
        line += 1
        size = 1 + 9 * (size or 1)
        total += 1 + size
    assert msg.startswith(f"--config {f}: line {line}:")
    _refused(capsys, ["merge", "--config", str(f), "--dry-run"], f"--config {f}: line {line}:")
    adapter = tmp_path / "adapter.yaml"
    adapter.write_text(
        _bomb("x").replace("\nx: ", "\nadapters:\n  - {path: a, weight: ").rstrip("\n") + "}\n"
    )
    with pytest.raises(cli.UsageError, match="aliases are expanded"):
        configfile.read_config(str(adapter))


def test_aliases_within_the_limit_and_merge_keys_are_plain_yaml(tmp_path):
    """Aliases that expand to few values, and YAML's merge key (<<, whose keys the mapping's own
    override: not a duplicate), read as PyYAML's safe_load reads them."""
    yaml = pytest.importorskip("yaml")
    text = (
        "w: &w [1, 0.5, 2]\nweights: *w\nbase: &b {budget: 2, method: ta}\n"
        "both: {<<: *b, budget: 3}\n"
    )
    f = tmp_path / "ok.yaml"
    f.write_text(text)
    data, version = configfile.read_config(str(f))
    assert data == yaml.safe_load(text) and version is None
    assert data["both"] == {"budget": 3, "method": "ta"}


def test_a_recursive_alias_is_refused(tmp_path):
    pytest.importorskip("yaml")
    f = tmp_path / "r.yaml"
    f.write_text("a: 1\nb: &x [1, *x]\n")
    with pytest.raises(cli.UsageError, match=rf"^--config {re.escape(str(f))}: line 2: the alias"):
        configfile.read_config(str(f))


def test_dev_zero_and_large_files_are_refused_without_reading_them_whole(
    tmp_path, capsys, monkeypatch
):
    if os.path.exists("/dev/zero"):
        t0 = time.perf_counter()
        _refused(capsys, ["merge", "--config", "/dev/zero", "--dry-run"],
                 "--config /dev/zero: holds a NUL byte (at byte 0): not a text file")  # fmt: skip
        assert time.perf_counter() - t0 < 5
    monkeypatch.setattr(configfile, "MAX_CONFIG_BYTES", 1000)
    f = tmp_path / "big.yaml"
    f.write_text("budget: 2\n" + "# padding\n" * 200)  # 2010 bytes of valid YAML
    with pytest.raises(cli.UsageError, match=r"larger than 0 MiB"):
        configfile.read_config(str(f))
    f.write_bytes(b"budget: \xff\n")
    with pytest.raises(cli.UsageError, match=r"not UTF-8 text \(byte 8\)"):
        configfile.read_config(str(f))


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_duplicate_keys_are_refused_naming_the_key_and_line(tmp_path, capsys, folders, suffix):
    """``budget: 4`` then ``budget: 2`` merged at 2 without a word; now refused naming the key
    and the second one's line, in YAML and JSON, at the top and inside an adapter item."""
    if suffix == ".yaml":
        pytest.importorskip("yaml")
        text = f"adapters: {json.dumps(folders)}\nbudget: 4\nmethod: ta\nbudget: 2\n"
        item = f"adapters:\n  - path: {folders[0]}\n    path: {folders[1]}\nbudget: 2\n"
    else:
        text = (
            f'{{"adapters": {json.dumps(folders)},\n "budget": 4,\n "method": "ta",\n "budget": 2}}'
        )
        item = f'{{"adapters": [\n {{"path": "{folders[0]}",\n  "path": "{folders[1]}"}}],\n "budget": 2}}'
    f = tmp_path / f"dup{suffix}"
    f.write_text(text)
    line = _line_of(text, '"budget"' if suffix == ".json" else "budget:", 2)
    _refused(capsys, ["merge", "--config", str(f), "--dry-run"],
             f"--config {f}: line {line}: key 'budget' is given twice in one mapping")  # fmt: skip
    f.write_text(item)
    line = _line_of(item, '"path"' if suffix == ".json" else "path:", 2)
    _refused(capsys, ["merge", "--config", str(f), "--dry-run"],
             f"--config {f}: line {line}: key 'path' is given twice")  # fmt: skip


def test_a_json_key_repeated_inside_a_nested_mapping_is_not_a_duplicate(tmp_path):
    """The same key in two mappings (or a nested one) is no duplicate; the line named is the
    repeated key's own, not that of the same key in a mapping inside."""
    f = tmp_path / "n.json"
    text = '{"a": {"path": 1},\n "b": {"path": 2},\n "c": {"x": {"path": 3},\n  "path": 4,\n  "path": 5}}'
    f.write_text(text)
    with pytest.raises(cli.UsageError, match=r": line 5: key 'path' is given twice"):
        configfile.read_config(str(f))
    f.write_text('{"a": {"path": 1}, "b": {"path": 2}}')
    assert configfile.read_config(str(f))[0] == {"a": {"path": 1}, "b": {"path": 2}}


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_nesting_and_integers_are_bounded(tmp_path, capsys, suffix):
    """5000 levels of nesting (RecursionError before) and a 5000-digit integer (ValueError
    before): one line naming the file and line. The limit is exact: MAX_DEPTH levels read."""
    if suffix == ".yaml":
        pytest.importorskip("yaml")
    f = tmp_path / f"n{suffix}"
    deep = "[" * 5000 + "]" * 5000
    f.write_text(f'{{"budget": 2,\n "x": {deep}}}')
    _refused(capsys, ["merge", "--config", str(f), "--dry-run"],
             f"--config {f}: line 2: nested deeper than {configfile.MAX_DEPTH} levels")  # fmt: skip
    f.write_text(f'{{"adapters": ["a"],\n "budget": {"9" * 5000}}}')
    _refused(capsys, ["merge", "--config", str(f), "--dry-run"],
             f"--config {f}: line 2: an integer of 5000 digits")  # fmt: skip
    ok = configfile.MAX_DEPTH - 1  # the mapping is the first level
    f.write_text('{"x": ' + "[" * ok + "]" * ok + "}")
    data = configfile.read_config(str(f))[0]
    depth, x = 1, data["x"]
    while isinstance(x, list):
        depth, x = depth + 1, (x[0] if x else None)
    assert depth == configfile.MAX_DEPTH
    f.write_text('{"x": ' + "[" * (ok + 1) + "]" * (ok + 1) + "}")
    with pytest.raises(cli.UsageError, match="nested deeper"):
        configfile.read_config(str(f))


def test_a_config_with_a_config_key_and_a_report_without_one(tmp_path, capsys):
    """A config that also has a ``config:`` mapping was read as a report, its own adapters and
    budget ignored without a word; a report without ``config`` was refused as "unknown key
    netutility_version"."""
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"adapters": ["a"], "budget": 2, "config": {"budget": 3}}))
    _refused(capsys, ["merge", "--config", str(f), "--dry-run"],
             "has a 'config' key, which only a merge report has")  # fmt: skip
    with pytest.raises(cli.UsageError, match=r"its own keys \(adapters, budget\) would be ignored"):
        configfile.read_config(str(f))
    f.write_text(json.dumps({"netutility_version": "0.1", "adapters": ["a"], "budget": 2}))
    _refused(capsys, ["merge", "--config", str(f), "--dry-run"],
             "a merge report (netutility_version '0.1') without a 'config' mapping")  # fmt: skip


def test_a_relative_config_path_not_found_names_the_resolved_path(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _refused(capsys, ["merge", "--config", "sub/m.yaml", "--dry-run"],
             f"--config sub/m.yaml ({tmp_path / 'sub' / 'm.yaml'}): no such file")  # fmt: skip


def test_a_relative_adapter_in_a_config_names_where_it_was_looked_for(
    tmp_path, capsys, monkeypatch
):
    """``org/name`` in a config, no folder there: the Hub's refusal names the folder it looked
    for first (relative to the config's folder)."""
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "cfg").mkdir()
    f = tmp_path / "cfg" / "m.json"
    f.write_text(json.dumps({"adapters": ["org/name", "org/other"], "budget": 2}))
    _refused(capsys, ["merge", "--config", str(f), "--dry-run"],
             f"adapters[0] org/name ({tmp_path / 'cfg' / 'org' / 'name'}): not a local folder")  # fmt: skip


def test_an_empty_hub_revision_is_a_malformed_id(folders, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _refused(capsys, ["merge", "org/name@", folders[0], "--budget", "2", "--dry-run"],
             "ADAPTER_DIR org/name@: not a local folder "
             f"({tmp_path / 'org' / 'name@'}), and not a well-formed Hugging Face Hub id: the "
             "revision after '@' is empty")  # fmt: skip
    assert nu.hub.id_problem("org/name@") == "the revision after '@' is empty"
    assert nu.hub.id_problem("org/name@v1") is None and nu.hub.id_problem("a/b/c@") is None


# ------------------------------------------------------------------------------ honest replay


@pytest.fixture(scope="module")
def merged(folders, tmp_path_factory):
    """A merge of copies of the adapters (the tests change them) and its report."""
    import shutil

    root = tmp_path_factory.mktemp("replay")
    copies = []
    for f in folders:
        shutil.copytree(f, root / pathlib.Path(f).name)
        copies.append(str(root / pathlib.Path(f).name))
    out = root / "merged"
    rc = cli.main(["merge", *copies, "--budget", "2", "--weights", "-1,0.5,2", "--no-plots",
                   "--quiet", "--out", str(out)])  # fmt: skip
    assert rc == 0
    return {"root": root, "copies": copies, "out": out}


def test_the_report_records_each_adapter_s_digest_and_a_replay_checks_it(merged, capsys):
    """Each adapter's SHA-256 (computed here) is in the report's config; an adapter changed in
    place since is refused by name, unless --allow-changed, which merges it as it is with a
    warning and records its new digest."""
    report = merged["out"] / cli.REPORT_NAME
    rep = json.loads(report.read_text())
    assert [a["sha256"] for a in rep["config"]["adapters"]] == [
        folder_digest(p) for p in merged["copies"]
    ]
    assert rep["netutility_version"] == nu.__version__
    rc, _, err = _run(capsys, "merge", "--config", str(report), "--dry-run")  # (unchanged)
    assert rc == 0 and "error" not in err, err
    changed = pathlib.Path(merged["copies"][1]) / "adapter_config.json"
    before = changed.read_text()
    try:
        cfg = json.loads(before)
        changed.write_text(json.dumps({**cfg, "lora_dropout": 0.25}))
        err = _refused(capsys, ["merge", "--config", str(report), "--out",
                                str(merged["root"] / "no")],
                       f"--config {report}: adapters[1] (task1) at {merged['copies'][1]} has "
                       "changed since that merge")  # fmt: skip
        assert "--allow-changed" in err and not (merged["root"] / "no").exists()
        again = merged["root"] / "again"
        rc, _, err = _run(capsys, "merge", "--config", str(report), "--out", str(again),
                            "--quiet", "--allow-changed")  # fmt: skip
        assert rc == 0, err
        assert "warning: --config" in err and "adapters[1] (task1)" in err
        new = json.loads((again / cli.REPORT_NAME).read_text())["config"]["adapters"]
        assert (
            new[1]["sha256"]
            == folder_digest(merged["copies"][1])
            != rep["config"]["adapters"][1]["sha256"]
        )
    finally:
        changed.write_text(before)


def test_an_adapter_changed_while_the_merge_runs_stops_it(merged, capsys, monkeypatch):
    """The report's digest is of the files the merge read: a folder changed between the checks
    and the end of the merge is refused, and nothing is written."""
    from netutility_jax.cli import merge as merge_cmd

    changed = pathlib.Path(merged["copies"][2]) / "adapter_config.json"
    before = changed.read_text()
    digests = []

    def resolve_then_change(args):
        config.resolve(args)
        digests.append(folder_digest(merged["copies"][2]))
        changed.write_text(json.dumps({**json.loads(before), "lora_dropout": 0.5}))
        digests.append(folder_digest(merged["copies"][2]))

    monkeypatch.setattr(merge_cmd, "resolve", resolve_then_change)
    out = merged["root"] / "during"
    try:
        _refused(capsys, ["merge", *merged["copies"], "--budget", "2", "--no-plots", "--quiet",
                          "--out", str(out)],
                 f"adapter task2 at {merged['copies'][2]}: its files changed while the merge "
                 "ran (SHA-256 ")  # fmt: skip
    finally:
        changed.write_text(before)
    assert digests[0] != digests[1] and not out.exists()
    assert not [p for p in merged["root"].iterdir() if "staging" in p.name]  # (none left)


def test_a_report_of_another_version_is_refused_unless_allowed(merged, capsys):
    rep = json.loads((merged["out"] / cli.REPORT_NAME).read_text())
    other = merged["root"] / "other_version.json"
    other.write_text(json.dumps({**rep, "netutility_version": "0.0.1"}))
    _refused(capsys, ["merge", "--config", str(other), "--dry-run"],
             f"the report was written by netutility-jax 0.0.1, this is {nu.__version__}")  # fmt: skip
    rc, _, err = _run(capsys, "merge", "--config", str(other), "--dry-run", "--allow-changed")
    assert rc == 0 and "warning" in err and "0.0.1" in err, err


def test_allow_changed_is_not_recorded_and_not_a_config_key(merged, tmp_path, capsys):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"adapters": merged["copies"], "budget": 2, "allow-changed": True}))
    _refused(capsys, ["merge", "--config", str(f), "--dry-run"],
             "key 'allow-changed' cannot be in a config")  # fmt: skip
    assert (
        "allow-changed" not in json.loads((merged["out"] / cli.REPORT_NAME).read_text())["config"]
    )


# ---------------------------------------------------------------------- --input-moments files


def test_unreadable_moments_archives_are_refused_naming_the_file(folders, tmp_path, capsys):
    """A plain .npy renamed .npz (TypeError before) and a damaged compressed .npz (zlib.error
    before): exit 2, one line naming the flag and the file."""
    rng = np.random.default_rng(0)
    s = {n: rng.normal(size=(24, 24)).astype(np.float32) for n in NAMES}  # (compresses little)
    npy = tmp_path / "plain.npz"
    with open(npy, "wb") as f:
        np.save(f, np.eye(24))
    good = tmp_path / "good.npz"
    np.savez_compressed(good, **s)
    data = bytearray(good.read_bytes())
    start = data.index(b".npy") + 4 + 64  # into the first member's compressed bytes
    data[start : start + 32] = bytes(b ^ 0xA5 for b in data[start : start + 32])
    bad = tmp_path / "bad.npz"
    bad.write_bytes(bytes(data))
    for f, what in (
        (npy, "not an .npz archive (a single .npy array)"),
        (bad, f"member '{NAMES[0]}.npy' cannot be read"),
    ):
        _refused(capsys, ["merge", *folders, "--budget", "2", "--dry-run", "--input-moments",
                          str(f), "none", "none"], f"--input-moments {f}: {what}")  # fmt: skip
    with pytest.raises(InputError, match=r"^nu\.moments\.load_input_moments\("):
        nu.moments.load_input_moments(bad)


def test_input_moments_before_the_adapters_names_the_flag(folders, capsys):
    _refused(capsys, ["merge", "--input-moments", "none", "none", "none", *folders, "--budget",
                      "2", "--dry-run"],
             "no adapters: --input-moments took every name after it")  # fmt: skip


def test_the_documented_moments_writer_exists():
    """README, ``merge --help`` and the command's messages name ``nu.moments.save_input_moments``
    (``nu.save_input_moments`` does not exist); every ``nu.<name>`` the help names resolves."""
    parser = cli.build_parser(demo_options=False)
    sub = next(a for a in parser._actions if a.dest == "command").choices["merge"]
    here = pathlib.Path(cli.__file__).parent
    text = sub.format_help() + (here / "config.py").read_text() + (here / "load.py").read_text()
    names = set(re.findall(r"\bnu\.((?:[a-z_]+\.)*[a-z_]+)", " ".join(text.split())))
    assert "moments.save_input_moments" in names and "save_input_moments" not in names
    for name in names:
        obj = nu
        for part in name.split("."):
            assert hasattr(obj, part), f"nu.{name} does not exist"
            obj = getattr(obj, part)
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "nu.moments.save_input_moments" in readme
    assert not re.search(r"(?<!moments\.)\bnu\.save_input_moments", readme)


# ------------------------------------------------------------------------------ flag messages


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--weights", "1e-40,1,1"], "argument --weights: expected a comma list of weights"),
        (["--weights", "1e300,1,1"], "'1e300' is not"),
        (["--weights", "1e-300,1,1"], "'1e-300' is not"),
        (["--weights=1,0,1"], "'0' is not"),
        (["--alpha", "1e308"], "argument --alpha: expected 'auto' or a number in [0, 16]"),
        (["--lam", "1e308"], "argument --lam: expected 'auto' or a number in [0, 1e+30]"),
        (["--lam", "-1"], "argument --lam: "),
        (["--coef", "0"], "argument --coef: expected a finite nonzero number"),
        (["--coef", "-inf"], "argument --coef: "),
    ],
)
def test_numeric_flags_are_refused_by_their_flag_name(folders, tmp_path, capsys, flags, message):
    """Values the library would refuse in its Python terms (a LoRA "scale", ``lam=``, x64)
    are refused on the command line by the flag and the value given."""
    err = _refused(capsys, ["merge", *folders, "--budget", "2", "--out", str(tmp_path / "o"),
                            *flags], message)  # fmt: skip
    assert "scale" not in err and "lam=" not in err and "x64" not in err
    assert not (tmp_path / "o").exists()


def test_a_config_weight_out_of_range_is_refused_by_its_key(tmp_path, capsys):
    f = tmp_path / "w.json"
    f.write_text(json.dumps({"adapters": [{"path": "a", "weight": 1e-40}], "budget": 2}))
    _refused(capsys, ["merge", "--config", str(f), "--dry-run"],
             "adapters[0] 'weight' is '1e-40'; expected a nonzero number between 1e-30 and 1e+30")  # fmt: skip
    f.write_text(json.dumps({"adapters": ["a"], "budget": 2, "alpha": 1e308}))
    _refused(capsys, ["merge", "--config", str(f), "--dry-run"],
             "key 'alpha' (--alpha): expected 'auto' or a number in [0, 16]")  # fmt: skip


def test_a_leading_negative_value_is_the_flag_s_value(folders, tmp_path):
    """``--weights -1,0.5,2`` (documented) was read by argparse as a flag; now the space form
    works as ``=`` does, for every flag that takes a number, and in a config's override."""
    parser = cli.build_parser(demo_options=False)
    base = ["merge", *folders, "--budget", "2", "--out", str(tmp_path / "o")]
    for form in (["--weights", "-1,0.5,2"], ["--weights=-1,0.5,2"]):
        assert parser.parse_args([*base, *form]).weights == (-1.0, 0.5, 2.0)
    args = parser.parse_args([*base, "--coef", "-1e-3", "--weights", "-1e-2,1,-2"])
    assert args.coef == -1e-3 and args.weights == (-0.01, 1.0, -2.0)
    assert "--weights -1,0.5,2" in " ".join(
        next(a for a in parser._actions if a.dest == "command")
        .choices["merge"]
        .format_help()
        .split()
    )
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"adapters": folders, "budget": 2, "weights": [1, 1, 1]}))
    argv = ["merge", "--config", str(f), "--weights", "-1,0.5,2", "--dry-run"]
    args = parser.parse_args(argv)
    args.argv = argv
    assert config.resolve(args).weights == (-1.0, 0.5, 2.0)  # (the flag's, over the file's)
    with pytest.raises(SystemExit):  # (a flag's missing value is still refused)
        parser.parse_args([*base, "--weights", "--quiet"])


def test_serving_ranks_too_small_names_the_flag(folders, tmp_path, capsys):
    _refused(capsys, ["merge", *folders, "--budget", "2", "--serving-ranks", "1", "--quiet",
                      "--no-plots", "--out", str(tmp_path / "o")],
             "--serving-ranks: a merged module has rank")  # fmt: skip
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ the library's own errors


def test_checkpoint_and_save_adapter_raise_the_library_s_errors(folders, tmp_path):
    """Bad input to ``nu.checkpoint.save`` / ``restore`` and ``nu.peft.save_adapter`` raises a
    ``nu.NetUtilityError`` that is still the built-in error older code catches."""
    ad = _adapter(0, 2)
    with pytest.raises(NetUtilityError) as e:
        nu.peft.save_adapter(ad, folders[0])
    assert isinstance(e.value, FileExistsError)
    (tmp_path / "f").write_text("")
    with pytest.raises(FileExistsError, match="is a file") as e:
        nu.peft.save_adapter(ad, tmp_path / "f")
    assert isinstance(e.value, NetUtilityError)
    pytest.importorskip("orbax.checkpoint")
    with pytest.raises(NetUtilityError) as e:
        nu.checkpoint.save(tmp_path, ad)
    assert isinstance(e.value, FileExistsError)
    with pytest.raises(MissingFileError) as e:
        nu.checkpoint.restore(tmp_path / "nope")
    assert isinstance(e.value, FileNotFoundError)
    with pytest.raises(InputError, match="is not a readable netutility-jax checkpoint") as e:
        nu.checkpoint.restore(tmp_path)
    assert isinstance(e.value, ValueError)
    assert issubclass(MissingFileError, FileNotFoundError)
    assert issubclass(FileAccessError, PermissionError) and issubclass(InputError, ValueError)


def test_demo_onto_existing_results_exits_2(tmp_path, capsys, monkeypatch):
    """``netutility demo`` onto results already there: exit 2 (bad input), not 1 (a bug)."""
    try:
        from netutility_jax.experiments.data import tasks
    except ImportError:
        pytest.skip("the experiment's extras are not installed")
    (tmp_path / "results.json").write_text("{}")
    monkeypatch.setattr(tasks, "load_tasks", lambda *a, **k: pytest.fail("loaded the tasks"))
    rc, _, err = _run(capsys, "demo", "--out", str(tmp_path))
    assert rc == 2 and "already exists" in err and err.count("\n") == 1, (rc, err)
    assert (tmp_path / "results.json").read_text() == "{}"


def test_the_help_states_the_loader_s_limits():
    """``merge --help`` states the limits the loader applies (its constants, not a copy)."""
    parser = cli.build_parser(demo_options=False)
    sub = next(a for a in parser._actions if a.dest == "command").choices["merge"]
    text = " ".join(next(a for a in sub._actions if a.dest == "config").help.split())
    assert f"over {configfile.MAX_CONFIG_BYTES // 2**20} MiB" in text
    assert f"deeper than {configfile.MAX_DEPTH} levels" in text
    assert f"past {configfile.MAX_NODES} values" in text and "--allow-changed" in text


# ------------------------------------------------------------------ inspect of an all-zero adapter


@pytest.fixture(scope="module")
def with_zero(folders, tmp_path_factory) -> list[str]:
    """task0, an adapter whose update is zero in every module (B = 0), task2."""
    p = tmp_path_factory.mktemp("zero") / "zero"
    ad = {n: {**m, "lora_b": np.zeros_like(m["lora_b"])} for n, m in _adapter(1, RANKS[1]).items()}
    nu.peft.save_adapter(ad, p, base_config=BASE)
    return [folders[0], str(p), folders[2]]


def _h_by_hand(seeds_ranks) -> float:
    """``Var_i log ||dW_i||_F^2`` from the dense updates ``scale * A @ B`` (float64)."""
    logs = []
    for seed, r in seeds_ranks:
        e = 0.0
        for m in _adapter(seed, r).values():
            dw = m["scale"] * (m["lora_a"].astype(np.float64) @ m["lora_b"].astype(np.float64))
            e += float((dw**2).sum())
        logs.append(np.log(e))
    return float(np.var(logs))


def test_inspect_says_why_h_is_undefined_and_what_alpha_auto_does(with_zero, folders, capsys):
    """An all-zero adapter: the table says h is undefined and why (that adapter, by its path,
    has no energy) and that ``--alpha auto`` refuses such a set, instead of a bare ``nan``; the
    JSON has ``heterogeneity: null`` and the same note. Without the all-zero adapter: no note, and
    h as computed here from the dense updates."""
    rc, out, err = _run(capsys, "inspect", *with_zero, "--alpha", "1")
    assert rc == 0, err
    assert "nan" not in out.lower(), out
    assert "heterogeneity h = undefined" in out
    note = [line for line in out.splitlines() if line.startswith("note: ")]
    assert len(note) == 1, out
    assert f"adapter '{with_zero[1]}' (task 1) has a zero update in every module" in note[0]
    assert "no energy" in note[0] and "--alpha auto needs h and refuses this set" in note[0]
    assert "--alpha 0 or 1" in note[0]
    energies = [float(line.split()[4]) for line in out.splitlines()[1:4]]
    assert energies[1] == 0 and energies[0] > 0 and energies[2] > 0
    rc, out, err = _run(capsys, "inspect", *with_zero, "--alpha", "0", "--json")
    assert rc == 0, err
    info = json.loads(out)
    assert (
        info["heterogeneity"] is None and "(task 1) has a zero update" in info["heterogeneity_note"]
    )
    rc, out, err = _run(capsys, "inspect", *folders, "--json")
    assert rc == 0, err
    info = json.loads(out)
    assert "heterogeneity_note" not in info
    h = _h_by_hand([(i, r) for i, r in enumerate(RANKS)])
    assert info["heterogeneity"] == pytest.approx(h, rel=1e-4)
    assert info["alpha"] == (0.0 if h > 1 else 1.0)


def test_inspect_with_alpha_auto_refuses_an_all_zero_adapter_by_name_and_flag(with_zero, capsys):
    """``--alpha auto`` (the default) cannot apply its rule without h: one line naming the
    adapter by its path and the flag, not "task 1" and ``alpha=``."""
    err = _refused(capsys, ["inspect", *with_zero],
                   f"--alpha auto: the heterogeneity h its rule needs is undefined: adapter "
                   f"'{with_zero[1]}' (task 1) has a zero update in every module",
                   start="netutility inspect: error: ")  # fmt: skip
    assert "alpha=" not in err and "--alpha 0 or 1" in err
    loaded = [nu.peft.load_adapter(p) for p in with_zero]
    with pytest.raises(InputError, match=r"^alpha=\"auto\": the heterogeneity h .* alpha=0 or"):
        cli.inspect_dict(loaded, with_zero, alpha="auto", lam="auto")
    info = cli.inspect_dict(loaded, with_zero, alpha=1.0, lam="auto")
    assert np.isnan(info["heterogeneity"]) and 'alpha="auto" needs h' in info["heterogeneity_note"]


# ------------------------------------------------------------------ zip bombs as --input-moments


def _deflated(path, members, *, declare=None) -> None:
    """An .npz at ``path`` whose members (``{name: (npy header dict, zero bytes after it)}``)
    are deflated as they are written (never whole in memory); ``declare``: the uncompressed size
    to write into every member's local and central headers instead of the true one (a lying
    archive)."""
    import io
    import struct
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, (head, n) in members.items():
            h = io.BytesIO()
            np.lib.format.write_array_header_1_0(h, head)
            with z.open(name, "w") as f:
                f.write(h.getvalue())
                chunk = bytes(1 << 20)
                while n > 0:
                    f.write(chunk[: min(n, len(chunk))])
                    n -= len(chunk)
    if declare is not None:
        data = bytearray(path.read_bytes())
        for sig, at in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
            i = data.find(sig)
            while i >= 0:
                data[i + at : i + at + 4] = struct.pack("<I", declare)
                i = data.find(sig, i + 4)
        path.write_bytes(bytes(data))


def _refused_small_and_fast(path, match: str) -> None:
    """``load_input_moments(path)`` raises an InputError matching ``match`` within a second,
    its Python allocations peaking under 50 MB (the bombs below hold 200 MB)."""
    tracemalloc.start()
    t = time.perf_counter()
    try:
        with pytest.raises(InputError, match=match):
            nu.moments.load_input_moments(path)
        elapsed = time.perf_counter() - t
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 1.0, elapsed
    assert peak < 50 * 2**20, peak


BOMB = 200 * 2**20  # bytes of zeros, deflated to about 200 kB


def test_a_zip_bomb_of_moments_is_refused_from_its_declared_size(folders, tmp_path, capsys):
    """200 MB of zeros deflated to ~200 kB: refused from the sizes the archive declares, naming
    the file and the member, within a second and without allocating the 200 MB; the same on
    the command line, naming the flag."""
    path = tmp_path / "bomb.npz"
    head = {"descr": "<f8", "fortran_order": False, "shape": (4096, BOMB // 8 // 4096)}
    _deflated(path, {f"{NAMES[0]}.npy": (head, BOMB)})
    size = path.stat().st_size
    assert size < BOMB // 500  # (it is a bomb)
    _refused_small_and_fast(
        path,
        rf"^nu\.moments\.load_input_moments\('{re.escape(str(path))}'\): member "
        rf"'{re.escape(NAMES[0])}\.npy' declares [\d,]+ bytes once decompressed .*zip bomb",
    )
    _refused(capsys, ["merge", *folders, "--budget", "2", "--dry-run", "--input-moments",
                      str(path), "none", "none"],
             f"--input-moments {path}: member '{NAMES[0]}.npy' declares")  # fmt: skip
    # many members each under the limit, together over it
    many = tmp_path / "many.npz"
    head = {"descr": "<f8", "fortran_order": False, "shape": (2**20,)}
    _deflated(many, {f"m{i}.npy": (head, 8 * 2**20) for i in range(25)})
    _refused_small_and_fast(many, r"its members declare [\d,]+ bytes once decompressed")


@pytest.mark.parametrize("declare", [4096, 20 * 2**20])
def test_a_zip_bomb_that_under_declares_its_size_reads_no_more_than_it_declares(tmp_path, declare):
    """The same bomb with its headers saying 4 kB (or 20 MB, within the limit): the member is
    read through a stream that stops at the declared size, and refused (the zip's CRC) naming
    the member, within a second and a few MB of memory."""
    path = tmp_path / "liar.npz"
    head = {"descr": "<f8", "fortran_order": False, "shape": (BOMB // 8,)}
    _deflated(path, {"q.npy": (head, BOMB)}, declare=declare)
    _refused_small_and_fast(path, r": member 'q\.npy' (cannot be read|holds|declares)")


def test_an_npy_header_cannot_make_the_reader_allocate_what_is_not_there(tmp_path):
    """A stored member of 128 bytes whose .npy header declares 10**12 float64 values: refused by
    the bytes it holds (np.load would allocate the 8 TB first: a MemoryError)."""
    import io
    import zipfile

    h = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        h, {"descr": "<f8", "fortran_order": False, "shape": (10**6, 10**6)}
    )
    path = tmp_path / "header.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("q.npy", h.getvalue() + bytes(64))
    _refused_small_and_fast(
        path, r"member 'q\.npy' declares a float64 array of shape \(1000000, 1000000\)"
    )


def test_compressed_and_fortran_order_moments_still_load_and_max_bytes_bounds_them(tmp_path):
    """Ordinary archives read as before: np.savez_compressed second moments give S back (up to
    the factor's float32), and a Fortran-order factor (not symmetric: a transposed read would
    show) comes back entry for entry; ``max_bytes`` below the arrays' size refuses, at it
    loads."""
    import zipfile

    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 12))
    s = {"a": x.T @ x / 40, "b": x[:, ::-1].T @ x[:, ::-1] / 40}
    comp = tmp_path / "c.npz"
    np.savez_compressed(comp, **s)
    back = nu.moments.load_input_moments(comp)
    for k, v in s.items():
        np.testing.assert_allclose(back[k].second_moment(), v, rtol=0, atol=1e-5 * abs(v).max())
    f = rng.normal(size=(7, 12)).astype(np.float32)
    head = {"format": "netutility-input-moments", "version": "1", "form": "factor",
            "data_free": ["c"]}  # fmt: skip
    fort = tmp_path / "f.npz"
    np.savez(fort, a=np.asfortranarray(f), __netutility__=np.asarray(json.dumps(head)))
    back = nu.moments.load_input_moments(fort)
    assert back["c"] is None and np.array_equal(np.asarray(back["a"].factor), f)
    with zipfile.ZipFile(comp) as z:
        total = sum(i.file_size for i in z.infolist())
    with pytest.raises(InputError, match=r"its members declare .* or pass a larger max_bytes="):
        nu.moments.load_input_moments(comp, max_bytes=total - 1)
    assert set(nu.moments.load_input_moments(comp, max_bytes=total)) == {"a", "b"}
    with pytest.raises(nu.errors.InputTypeError, match="max_bytes"):
        nu.moments.load_input_moments(comp, max_bytes=1.5)
