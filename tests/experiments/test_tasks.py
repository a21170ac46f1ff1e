"""netutility_jax.experiments.data.tasks: built-in tasks from Debian data, CSV tasks, the R reader.

The built-in tasks need Debian packages (``tasks.APT_INSTALL_COMMAND``); without them those tests
skip and say what to install. The CSV, error and R-reader tests need nothing installed.
"""

from __future__ import annotations

import functools
import gzip
import lzma
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from netutility_jax.experiments.data import task_sources
from netutility_jax.experiments.data import tasks as T


def _needs_data(name: str):
    info = T.TASK_INFO[name]
    return pytest.param(
        name,
        marks=pytest.mark.skipif(
            not T.data_available(name),
            reason=f"Debian package {info.apt_package} is not installed; install the data for "
            f"all built-in tasks with: {T.APT_INSTALL_COMMAND}",
        ),
    )


BUILTIN = [_needs_data(name) for name in T.BUILTIN_TASKS]


@functools.cache
def _load(name: str, seed: int = 0, max_train: int = T.DEFAULT_MAX_TRAIN) -> T.Task:
    return T.load_task(name, seed=seed, max_train=max_train)


def _check_task(task: T.Task, labels: tuple[str, ...]) -> None:
    assert task.labels == labels
    assert len(set(task.labels)) == len(task.labels) >= 2
    seen: dict[str, str] = {}
    for split_name, split in task.splits.items():
        assert isinstance(split.texts, tuple)
        assert split.labels.dtype == np.int32
        assert split.labels.shape == (len(split.texts),)
        assert not split.labels.flags.writeable
        assert split.labels.min() >= 0 and split.labels.max() < task.num_labels
        assert set(split.labels.tolist()) == set(range(task.num_labels)), split_name
        for text in split.texts:
            assert isinstance(text, str) and text.strip() == text and text
            assert text not in seen, f"{text!r} is in {seen.get(text)} and {split_name}"
            seen[text] = split_name


# -- built-in tasks ------------------------------------------------------------------------------


def test_builtin_registry() -> None:
    assert len(T.BUILTIN_TASKS) >= 6
    assert set(T.TASK_INFO) == set(T.BUILTIN_TASKS)
    table = T.describe()
    for name, info in T.TASK_INFO.items():
        assert name in table and info.apt_package in T.APT_INSTALL_COMMAND
        assert name in T.__doc__
        assert " / ".join(map(str, info.default_sizes)) in T.__doc__
        assert len(set(info.labels)) == len(info.labels) >= 2
    assert T.describe("word_pos").startswith("word_pos:")
    with pytest.raises(KeyError, match="unknown task 'nope'"):
        T.describe("nope")
    with pytest.raises(KeyError, match="unknown task 'nope'"):
        T.load_task("nope")


@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_task_splits(name: str) -> None:
    task = _load(name)
    info = T.TASK_INFO[name]
    assert task.name == name
    _check_task(task, info.labels)
    assert (len(task.train), len(task.val), len(task.test)) == info.default_sizes
    for split in task.splits.values():  # balanced
        counts = np.bincount(split.labels, minlength=task.num_labels)
        assert counts.min() == counts.max()
    assert info.apt_package in task.source
    assert name in task.describe()


@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_task_determinism(name: str) -> None:
    a, b = _load(name), T.load_task(name)
    for split in ("train", "val", "test"):
        assert a.splits[split].texts == b.splits[split].texts
        np.testing.assert_array_equal(a.splits[split].labels, b.splits[split].labels)
    c = _load(name, seed=1)
    _check_task(c, a.labels)
    for split in ("train", "val", "test"):
        assert set(a.splits[split].texts) != set(c.splits[split].texts)


@pytest.mark.parametrize("name", BUILTIN)
def test_smaller_train_keeps_eval_splits(name: str) -> None:
    full, small = _load(name), _load(name, max_train=200)
    assert small.val.texts == full.val.texts and small.test.texts == full.test.texts
    assert len(small.train) == 200 // full.num_labels * full.num_labels
    assert set(small.train.texts) <= set(full.train.texts)


def test_load_tasks_all() -> None:
    missing = [n for n in T.BUILTIN_TASKS if not T.data_available(n)]
    if missing:
        pytest.skip(f"Debian data missing for {missing}; install with: {T.APT_INSTALL_COMMAND}")
    loaded = T.load_tasks()
    assert [t.name for t in loaded] == list(T.BUILTIN_TASKS)
    with pytest.raises(T.TaskDataError, match="task names repeat"):
        T.load_tasks(["word_pos", "word_pos"])


def test_permutation_is_pinned() -> None:
    # The split order must not drift across numpy versions or machines: it uses only
    # SeedSequence and PCG64.random_raw, whose outputs numpy keeps stable.
    perm = T._permutation(10, 0, 1, 2)
    assert perm.tolist() == [8, 3, 4, 7, 6, 1, 5, 9, 2, 0]
    assert T._permutation(10, 1, 1, 2).tolist() != perm.tolist()


@pytest.mark.parametrize("name", T.BUILTIN_TASKS)
def test_missing_data_names_apt_command(name, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(T, "R_LIBRARY_DIRS", (str(tmp_path),))
    monkeypatch.setattr(T, "WORDNET_DIRS", (str(tmp_path),))
    package = T.TASK_INFO[name].apt_package
    assert not T.data_available(name)
    with pytest.raises(T.TaskDataMissingError) as info:
        T.load_task(name)
    err = info.value
    assert isinstance(err, FileNotFoundError)
    assert err.install_command == f"apt-get install -y --no-install-recommends {package}"
    message = str(err)
    assert f"`apt-get install -y --no-install-recommends {package}`" in message
    assert T.APT_INSTALL_COMMAND in message
    assert str(tmp_path) in message


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seed": -1}, "seed must be an integer >= 0"),
        ({"max_train": 0}, "max_train must be an integer >= 1"),
        ({"n_val": 0}, "n_val must be an integer >= 1"),
        ({"n_test": 2.5}, "n_test must be an integer >= 1"),
    ],
)
def test_bad_sizes(kwargs, match) -> None:
    with pytest.raises(T.TaskDataError, match=match):
        T.load_task("word_pos", **kwargs)


# -- CSV tasks -------------------------------------------------------------------------------


def _write(tmp_path: Path, text: str, name: str = "task.csv") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _csv_rows(n_per_label: dict[str, int]) -> str:
    lines = ["id,text,label"]
    for label, n in n_per_label.items():
        lines += [f'{i},"{label} example, number {i}",{label}' for i in range(n)]
    return "\n".join(lines) + "\n"


def test_csv_task(tmp_path) -> None:
    body = _csv_rows({"spam": 40, "ham": 160, "eggs": 3})
    body += '999,"  ham   example, number 1 ",ham\n'  # duplicate after whitespace cleanup
    body += "1000,conflicting,ham\n1001,conflicting,spam\n1002,,ham\n1003,no label,\n"
    path = _write(tmp_path, "\ufeff" + body)  # with a byte-order mark
    task = T.load_csv_task("mine", path)
    _check_task(task, ("eggs", "ham", "spam"))
    assert task.name == "mine" and task.source == str(path)
    assert len(task.train) + len(task.val) + len(task.test) == 203
    assert not any("conflicting" in t for s in task.splits.values() for t in s.texts)
    counts = {s: np.bincount(task.splits[s].labels, minlength=3).tolist() for s in task.splits}
    assert counts == {"train": [1, 96, 24], "val": [1, 24, 6], "test": [1, 40, 10]}

    again = T.load_csv_task("mine", path)
    assert again.test.texts == task.test.texts and again.train.texts == task.train.texts
    other = T.load_csv_task("mine", path, seed=3)
    assert set(other.test.texts) != set(task.test.texts)

    small = T.load_csv_task("mine", path, max_train=20, n_val=12, n_test=20)
    _check_task(small, ("eggs", "ham", "spam"))
    assert len(small.train) <= 20


def test_task_args(tmp_path) -> None:
    path = _write(tmp_path, _csv_rows({"a": 10, "b": 10}))
    assert T.parse_task_arg(f"my-task.v1={path}") == ("my-task.v1", path)
    task = T.load_task_arg(f"mine={path}", seed=1)
    assert task.name == "mine" and task.labels == ("a", "b")
    assert [t.name for t in T.load_tasks([f"x={path}", f"y={path}"])] == ["x", "y"]
    assert [t.name for t in T.load_tasks(f"x={path}")] == ["x"]
    for arg, match in [
        ("mine.csv", "expected NAME=PATH.csv"),
        ("mine=", "expected NAME=PATH.csv"),
        ("=x.csv", "task name '' in '=x.csv' must be"),
        ("my task=x.csv", "task name 'my task' in 'my task=x.csv' must be"),
        ("word_pos=x.csv", "task name 'word_pos' is a built-in task"),
    ]:
        with pytest.raises(T.TaskDataError, match=match):
            T.parse_task_arg(arg)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("", r"task 'bad': .*bad\.csv is empty \(expected a header text,label\)"),
        ("text,category\nhello,a\n", r"has no column 'label' \(header: \['text', 'category'\]\)"),
        ("sentence,label\nhello,a\n", r"has no column 'text'"),
        ("text,label\n", "has no rows with a text and a label"),
        ("text,label\n,a\nb,\n", "has no rows with a text and a label"),
        ("text,label\nx,a\ny,a\nz,a\n", r"fewer than 2 labels \(\['a'\]\)"),
        (
            "text,label\nx,a\ny,a\nz,a\nu,b\nv,b\n",
            r"too few examples to split: \{'b': 2\}; each label needs at least 3",
        ),
    ],
)
def test_bad_csv(tmp_path, body, match) -> None:
    path = _write(tmp_path, body, "bad.csv")
    with pytest.raises(T.TaskDataError, match=match):
        T.load_csv_task("bad", path)


def test_csv_unterminated_quote_names_the_line(tmp_path) -> None:
    # Python's csv module would read the rest of the file into one field, losing the rows
    body = 'text,label\nfine,a\nfine too,b\n"opened here,a\nlost,b\nlost too,a\n'
    path = _write(tmp_path, body, "q.csv")
    with pytest.raises(T.TaskDataError, match=r"task 'q': .*q\.csv: line 4: .*never closed"):
        T.load_csv_task("q", path)
    # a quoted field over several lines is legitimate
    ok = "text,label\n" + "".join(f'"line one {i}\nline two",{"ab"[i % 2]}\n' for i in range(12))
    task = T.load_csv_task("q", _write(tmp_path, ok, "ok.csv"))
    assert sum(map(len, task.splits.values())) == 12
    assert any("\n" not in t and "line two" in t for t in task.train.texts)  # whitespace cleaned


def test_csv_duplicate_columns_and_encoding(tmp_path) -> None:
    path = _write(tmp_path, "text,label,text\nx,a,y\n", "dup.csv")
    with pytest.raises(
        T.TaskDataError,
        match=r"task 'd': .*dup\.csv: the header names column\(s\) 'text' more than once",
    ):
        T.load_csv_task("d", path)
    bad = tmp_path / "latin.csv"
    bad.write_bytes("text,label\ncaf\xe9,a\n".encode("latin-1"))
    with pytest.raises(
        T.TaskDataError,
        match=r"task 'l': .*latin\.csv is not UTF-8 \(byte b'\\xe9' at offset 14\); save it as UTF-8",
    ):
        T.load_csv_task("l", bad)
    with pytest.raises(T.TaskDataError, match=r"task 'dir': .* is a directory; give the CSV file"):
        T.load_csv_task("dir", tmp_path)


def test_builtin_label_texts() -> None:
    for name, info in T.TASK_INFO.items():
        assert len(info.label_texts) == len(info.labels), name
        assert all(t.strip() == t and t for t in info.label_texts), name
    with pytest.raises(T.TaskDataError, match="2 label texts for 3 labels"):
        split = T.Split(("x",), np.array([0]))
        T.Task("t", ("a", "b", "c"), split, split, split, label_texts=("x", "y"))


def test_word_relation_pairs() -> None:
    if not T.data_available("word_relation"):
        pytest.skip(f"wordnet-base is not installed; install with: {T.APT_INSTALL_COMMAND}")
    task = _load("word_relation")
    assert task.pair and T.TASK_INFO["word_relation"].pair
    texts = dict(
        zip(
            task.train.texts + task.test.texts + task.val.texts,
            np.concatenate([task.train.labels, task.test.labels, task.val.labels]),
            strict=True,
        )
    )
    for text in texts:
        a, b = text.split(T.PAIR_SEP)
        assert a and b and a != b and T.PAIR_SEP not in a + b
    lab = {name: i for i, name in enumerate(task.labels)}
    # WordNet facts: wheel is a part of a car, hot/cold are antonyms (one order is kept)
    rows = T._cached_rows("word_relation", tuple(T.R_LIBRARY_DIRS), tuple(T.WORDNET_DIRS))
    assert "cold ; hot" in rows["antonym"] and "hot ; cold" not in rows["antonym"]
    assert any(t.endswith(" ; car") for t in rows["part"])
    assert "dog ; canine" in rows["hypernym"]
    assert lab["part"] in set(texts.values())


def test_missing_csv(tmp_path) -> None:
    with pytest.raises(T.TaskDataError, match=r"CSV file .*nothere\.csv does not exist"):
        T.load_task_arg(f"x={tmp_path / 'nothere.csv'}")


# -- the R serialization reader -------------------------------------------------------------


def _i(*values: int) -> bytes:
    return struct.pack(f">{len(values)}i", *values)


def _chars(s: str | None) -> bytes:
    if s is None:
        return _i(9, -1)
    raw = s.encode("utf-8")
    return _i(9 | (8 << 12), len(raw)) + raw  # UTF8 flag


def _strs(*values: str | None) -> bytes:
    return _i(16, len(values)) + b"".join(_chars(v) for v in values)


def _sym(name: str) -> bytes:
    return _i(1) + _chars(name)


def _attrs(pairs: list[tuple[str, bytes]]) -> bytes:
    out = b""
    for tag, value in pairs:
        out += _i(2 | (1 << 10)) + _sym(tag) + value
    return out + _i(254)


def _serialize(body: bytes) -> bytes:
    return b"X\n" + _i(3, 0x040201, 0x030500, 5) + b"UTF-8" + body


def _frame() -> bytes:
    factor = _i(13 | (1 << 8) | (1 << 9), 3, 2, 1, -(2**31))
    factor += _attrs([("levels", _strs("neg", "pos")), ("class", _strs("factor"))])
    real = _i(14, 3) + struct.pack(">3d", 0.5, 1.5, 2.5)
    names = _strs("word", "label", "x")
    row_names = _i(13, 2, -(2**31), -3)
    body = _i(19 | (1 << 8) | (1 << 9), 3) + _strs("good", None, "bad") + factor + real
    return body + _attrs(
        [("names", names), ("row.names", row_names), ("class", _strs("data.frame"))]
    )


def test_read_r_serialized() -> None:
    frame = T.read_r_serialized(_serialize(_frame()))
    assert list(frame) == ["word", "label", "x"]
    assert frame["word"] == ["good", None, "bad"]
    assert frame["label"] == ["pos", "neg", None]
    np.testing.assert_array_equal(frame["x"], [0.5, 1.5, 2.5])
    # A reference to an earlier symbol (REFSXP) in a second attribute list.
    shared = _i(19 | (1 << 9), 1) + _strs("a")
    shared += _i(2 | (1 << 10)) + _sym("names") + _strs("k") + _i(254)
    both = _i(19, 2) + shared + _i(19 | (1 << 9), 1) + _strs("b")
    both += _i(2 | (1 << 10)) + _i(255 | (1 << 8)) + _strs("m") + _i(254)
    assert T.read_r_serialized(_serialize(both)) == [{"k": ["a"]}, {"m": ["b"]}]
    with pytest.raises(ValueError, match="not an R serialization"):
        T.read_r_serialized(b"RDX3\n")
    with pytest.raises(ValueError, match="unsupported R object type 4"):
        T.read_r_serialized(_serialize(_i(4, 0)))


@pytest.mark.parametrize("compressed", [1, 2, 3])
def test_read_r_lazyload(tmp_path, compressed) -> None:
    raw = _serialize(_frame())
    if compressed == 1:
        entry = zlib.compress(raw)
    elif compressed == 2:
        entry = b"1" + zlib.compress(raw)
    else:
        filters = [{"id": lzma.FILTER_LZMA2, "preset": 6}]
        entry = b"Z" + lzma.compress(raw, format=lzma.FORMAT_RAW, filters=filters)
    blob = b"\0" * 7 + struct.pack(">I", len(raw)) + entry
    (tmp_path / "Rdata.rdb").write_bytes(blob)
    offsets = _i(19 | (1 << 9), 1, 13, 2, 7, len(blob) - 7) + _attrs([("names", _strs("df"))])
    index = _i(19 | (1 << 9), 2) + offsets + _i(13, 1, compressed)
    index += _attrs([("names", _strs("variables", "compressed"))])
    (tmp_path / "Rdata.rdx").write_bytes(gzip.compress(_serialize(index)))
    frame = T.read_r_lazyload(tmp_path / "Rdata", "df")
    assert frame["label"] == ["pos", "neg", None]
    with pytest.raises(KeyError, match=r"'other' is not in .*Rdata\.rdx \(it holds \['df'\]\)"):
        T.read_r_lazyload(tmp_path / "Rdata", "other")


@pytest.mark.skipif(
    not T.data_available("word_sentiment"),
    reason=f"r-cran-tidytext is not installed; install with: {T.APT_INSTALL_COMMAND}",
)
def test_reader_matches_rdata() -> None:
    rdata = pytest.importorskip("rdata")
    base = Path(task_sources._r_data_base("word_sentiment", "tidytext", T.R_LIBRARY_DIRS))
    ours = T.read_r_lazyload(base, "stop_words")
    with open(base.with_suffix(".rdx"), "rb") as f:
        offsets = T.read_r_serialized(gzip.decompress(f.read()))["variables"]["stop_words"]
    with open(base.with_suffix(".rdb"), "rb") as f:
        f.seek(int(offsets[0]))
        raw = zlib.decompress(f.read(int(offsets[1]))[4:])
    parsed = rdata.parser.parse_data(raw, extension=".rds")
    columns = [obj.value for obj in parsed.object.value]
    theirs = [[None if c.value is None else c.value.decode() for c in col] for col in columns]
    assert theirs == [ours["word"], ours["lexicon"]]
