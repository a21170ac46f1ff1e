"""The six NLI datasets of the paper's language suite, read from local files in the hub's formats.

The paper (Appendix B) trains one LoRA per task on SNLI, MNLI, SICK, QNLI, RTE and SciTail, all
in **one three-way label space** (:data:`LABELS`: 0 entailment, 1 neutral, 2 contradiction) so
that every adapter and head has the same shape. Binary datasets are mapped into it as the paper
says: for RTE and QNLI *not-entailment* becomes class 2 (contradiction) and class 1 is unused;
for SciTail *neutral* keeps class 1 and class 2 is unused. An unused class is masked at training
and evaluation time (:mod:`nli_head`); here it is named by :data:`UNUSED` in the task's
``label_texts``, which is where the head reads its mask from.

**Layout.** ``DATA/<dataset>/<split>.<ext>`` with ``<ext>`` one of :data:`FORMATS` (parquet,
jsonl, json, csv, tsv), or parquet shards ``DATA/<dataset>/<split>-*.parquet`` (the hub's
``train-00000-of-00001.parquet``). Where the dataset folder holds no such file, its subfolders
are searched too, the hub's configuration folders first (``plain_text/`` of SNLI, ``mnli/``,
``qnli/``, ``rte/`` of GLUE, ``tsv_format/`` then ``snli_format/`` of SciTail), so a folder
downloaded from the hub as is (``huggingface-cli download stanfordnlp/snli --repo-type dataset
--local-dir DATA/snli``) is read without renaming. Parquet needs ``pyarrow`` (imported only when
a parquet file is met; ``pip install pyarrow``); the other formats need nothing.

**Fields** (the hub's own names, :data:`DATASETS`; the first field set a file has is used):

==========  ==============================  =========================================  ====================
dataset     hub                             fields (premise, hypothesis, label)        label values
==========  ==============================  =========================================  ====================
snli        stanfordnlp/snli                premise, hypothesis, label;                0/1/2, -1 dropped;
                                            sentence1, sentence2, gold_label (jsonl)   strings, "-" dropped
mnli        nyu-mll/glue (mnli),            as snli; validation file                   as snli
            nyu-mll/multi_nli               ``validation_matched``
sick        RobZamp/sick                    sentence_A, sentence_B, label;             0/1/2; strings
                                            sentence_A, sentence_B, entailment_label   (any case)
qnli        nyu-mll/glue (qnli)             question, sentence, label                  0 = entailment,
                                                                                       1 = not_entailment
rte         nyu-mll/glue (rte)              sentence1, sentence2, label;               as qnli
                                            premise, hypothesis, label (SuperGLUE)
scitail     allenai/scitail                 premise, hypothesis, label (tsv_format,    "entails",
                                            also headerless .tsv); sentence1,          "neutral"
                                            sentence2, gold_label (snli_format)
==========  ==============================  =========================================  ====================

Labels in CSV/TSV files are text: ``"0"`` reads as 0. A value outside a dataset's table is an
error naming the file, row and value; a row without a gold label (-1, ``"-"``) is dropped, as
the hub's users do.

The datasets' splits under the suite's protocol (validation and test, size caps) and the tasks
made of them are :mod:`nli_tasks`'s (``nli_tasks.load_task``).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import pathlib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ...errors import InputError, MissingFileError
from . import tasks as tk

__all__ = [
    "DATASETS",
    "FORMATS",
    "LABELS",
    "NAMES",
    "UNUSED",
    "DatasetSpec",
    "FieldSet",
    "NLIDataError",
    "check_data",
    "dataset_spec",
    "find_split",
    "read_split",
]

#: The unified label space of every task (Appendix B), class ``i`` is ``LABELS[i]``.
LABELS = ("entailment", "neutral", "contradiction")
#: The ``label_texts`` entry of a class a dataset does not use (masked in training and eval).
UNUSED = "(unused)"
#: The paper's six tasks, in its order.
NAMES = ("snli", "mnli", "sick", "qnli", "rte", "scitail")
#: File formats read, in the order they are looked for.
FORMATS = (".parquet", ".jsonl", ".json", ".csv", ".tsv")


class NLIDataError(InputError):
    """An NLI data file that cannot be read as its dataset (missing field, bad label, no rows)."""


class FieldSet(NamedTuple):
    """The names of a file's premise, hypothesis and label fields."""

    premise: str
    hypothesis: str
    label: str


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """How one dataset is stored and mapped into :data:`LABELS`.

    Attributes:
      name: the folder name under ``DATA`` and the task name.
      title: the dataset's name in reports.
      hub: where the hub distributes it.
      fields: accepted field sets, in order of preference.
      labels: raw label value (int, or lower-case string) -> class in :data:`LABELS`, or None
        for an example without a gold label (dropped).
      label_texts: what each class of :data:`LABELS` is called in this dataset (:data:`UNUSED`
        for a class it never uses: masked).
      validation, test: file stems of the official validation and test splits, in order of
        preference.
      configs: the hub's configuration subfolders, searched first when the dataset folder has
        no split file of its own.
      headerless: the fields of a ``.tsv`` file without a header row (SciTail's own release),
        or None.
    """

    name: str
    title: str
    hub: str
    fields: tuple[FieldSet, ...]
    labels: Mapping[int | str, int | None]
    label_texts: tuple[str, str, str]
    validation: tuple[str, ...] = ("validation", "dev")
    test: tuple[str, ...] = ("test",)
    configs: tuple[str, ...] = ()
    headerless: FieldSet | None = None

    @property
    def used(self) -> tuple[bool, ...]:
        """Which classes of :data:`LABELS` the dataset uses."""
        return tuple(t != UNUSED for t in self.label_texts)


_THREE = {0: 0, 1: 1, 2: 2, "entailment": 0, "neutral": 1, "contradiction": 2}
_NO_GOLD = {-1: None, "-": None, "": None}
_BINARY = {0: 0, 1: 2, -1: None, "entailment": 0, "not_entailment": 2}
_PAIR = FieldSet("premise", "hypothesis", "label")
_SNLI_JSONL = FieldSet("sentence1", "sentence2", "gold_label")

DATASETS: dict[str, DatasetSpec] = {
    s.name: s
    for s in (
        DatasetSpec(
            "snli", "SNLI", "stanfordnlp/snli", (_PAIR, _SNLI_JSONL), {**_THREE, **_NO_GOLD},
            LABELS, configs=("plain_text",),
        ),
        DatasetSpec(
            "mnli", "MNLI", "nyu-mll/glue (mnli) or nyu-mll/multi_nli", (_PAIR, _SNLI_JSONL),
            {**_THREE, **_NO_GOLD}, LABELS,
            validation=("validation_matched", "dev_matched", "validation"),
            test=("test_matched", "test"), configs=("mnli", "default", "plain_text"),
        ),
        DatasetSpec(
            "sick", "SICK", "RobZamp/sick",
            (FieldSet("sentence_A", "sentence_B", "label"),
             FieldSet("sentence_A", "sentence_B", "entailment_label")),
            _THREE, LABELS, configs=("default",),
        ),
        DatasetSpec(
            "qnli", "QNLI", "nyu-mll/glue (qnli)", (FieldSet("question", "sentence", "label"),),
            _BINARY, ("entailment", UNUSED, "not_entailment"), configs=("qnli",),
        ),
        DatasetSpec(
            "rte", "RTE", "nyu-mll/glue (rte)", (FieldSet("sentence1", "sentence2", "label"), _PAIR),
            _BINARY, ("entailment", UNUSED, "not_entailment"), configs=("rte",),
        ),
        DatasetSpec(
            "scitail", "SciTail", "allenai/scitail", (_PAIR, _SNLI_JSONL),
            {"entails": 0, "entailment": 0, "neutral": 1}, ("entails", "neutral", UNUSED),
            configs=("tsv_format", "snli_format", "dgem_format"), headerless=_PAIR,
        ),
    )
}  # fmt: skip


def dataset_spec(name: str) -> DatasetSpec:
    """The spec of dataset ``name`` (a key of :data:`DATASETS`).

    Raises:
      NLIDataError: an unknown name.
    """
    try:
        return DATASETS[name]
    except KeyError:
        raise NLIDataError(
            f"nli_data: unknown dataset {name!r}; the NLI suite reads {', '.join(NAMES)}."
        ) from None


# ---------------------------------------------------------------------------------- finding


def _natural(p: pathlib.Path) -> list[Any]:
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", p.name)]


def _files_in(folder: pathlib.Path, stem: str) -> list[pathlib.Path]:
    """Files of split ``stem`` directly in ``folder``: ``stem.<ext>`` or ``stem-*.parquet``."""
    whole = [folder / f"{stem}{ext}" for ext in FORMATS if (folder / f"{stem}{ext}").is_file()]
    shards = sorted((p for p in folder.glob(f"{stem}-*.parquet") if p.is_file()), key=_natural)
    if len(whole) > 1 or (whole and shards):
        found = [p.name for p in (*whole, *shards)]
        raise NLIDataError(
            f"nli_data: {folder} holds split {stem!r} more than once ({', '.join(found)}); keep "
            "one file (or one set of parquet shards) per split."
        )
    return whole or shards


def find_split(
    data_dir: str | pathlib.Path, name: str, stems: Sequence[str]
) -> tuple[list[pathlib.Path], str] | None:
    """The files of the first of ``stems`` found for dataset ``name``, and that stem.

    Looks in ``DATA/<name>/``, then in the dataset's hub configuration subfolders
    (:attr:`DatasetSpec.configs`), then in any other subfolder (one only: several are
    ambiguous). Returns None if no stem has a file.

    Raises:
      MissingFileError: ``DATA/<name>`` is not a folder.
      NLIDataError: a split stored twice in one folder, or found in several subfolders.
    """
    spec = dataset_spec(name)
    root = pathlib.Path(data_dir) / name
    if not root.is_dir():
        raise MissingFileError(
            f"nli_data: no folder {root} for dataset {name!r} ({spec.title}, from {spec.hub}); "
            f"put its splits there as <split>{{{','.join(FORMATS)}}} files."
        )
    subs = sorted((p for p in root.iterdir() if p.is_dir()), key=_natural)
    preferred = [root / c for c in spec.configs if (root / c).is_dir()]
    others = [p for p in subs if p not in preferred]
    for stem in stems:
        files = _files_in(root, stem)
        if files:
            return files, stem
        for sub in preferred:
            files = _files_in(sub, stem)
            if files:
                return files, stem
        hits = [(sub, _files_in(sub, stem)) for sub in others]
        hits = [(sub, f) for sub, f in hits if f]
        if len(hits) > 1:
            raise NLIDataError(
                f"nli_data: split {stem!r} of {name!r} is in several subfolders of {root} "
                f"({', '.join(s.name for s, _ in hits)}); keep one, or move its files up to {root}."
            )
        if hits:
            return hits[0][1], stem
    return None


# ---------------------------------------------------------------------------------- reading


def _pyarrow_parquet(path: pathlib.Path) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise NLIDataError(
            f"nli_data: {path} is a parquet file; reading it needs pyarrow. Install it with: "
            "pip install pyarrow  (or convert the split to .jsonl)"
        ) from None
    return pq


def _choose(spec: DatasetSpec, present: Sequence[str], path: pathlib.Path) -> FieldSet:
    have = set(present)
    for fs in spec.fields:
        if set(fs) <= have:
            return fs
    want = " or ".join("(" + ", ".join(fs) + ")" for fs in spec.fields)
    first = spec.fields[0]
    missing = [f for f in first if f not in have]
    raise NLIDataError(
        f"nli_data: {path}: the {spec.name} reader needs the fields {want}; missing "
        f"{', '.join(map(repr, missing))}; the file has the fields {sorted(have)}."
    )


class _Columns(NamedTuple):
    fields: FieldSet
    premise: list[Any]
    hypothesis: list[Any]
    label: list[Any]


def _read_parquet(path: pathlib.Path, spec: DatasetSpec) -> _Columns:
    pq = _pyarrow_parquet(path)
    try:
        names = pq.read_schema(path).names
        fs = _choose(spec, names, path)
        table = pq.read_table(path, columns=list(fs))
    except NLIDataError:
        raise
    except Exception as e:  # pyarrow raises its own ArrowInvalid, OSError, ...
        raise NLIDataError(f"nli_data: {path} could not be read as parquet: {e}") from None
    return _Columns(fs, *(table.column(f).to_pylist() for f in fs))


def _records(path: pathlib.Path) -> Iterable[tuple[int, Any]]:
    """``(line or index, record)`` of a ``.jsonl`` file, or of a ``.json`` file holding JSON
    lines, an array of records or an object of columns."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None  # JSON lines in a .json file
        if isinstance(obj, list):
            return list(enumerate(obj, 1))
        if isinstance(obj, dict):
            cols = {k: v for k, v in obj.items() if isinstance(v, list)}
            n = {len(v) for v in cols.values()}
            if not cols:  # one record (JSON lines of one line)
                return [(1, obj)]
            if len(cols) == len(obj) and len(n) == 1:
                keys = list(cols)
                return [(i + 1, {k: cols[k][i] for k in keys}) for i in range(n.pop())]
            raise NLIDataError(
                f"nli_data: {path} holds a JSON object that is not columns of equal length; "
                "expected JSON lines, an array of records or {field: [values]}."
            )
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((i, json.loads(line)))
        except json.JSONDecodeError as e:
            raise NLIDataError(f"nli_data: {path}, line {i}: not JSON ({e.msg}).") from None
    return out


def _read_json(path: pathlib.Path, spec: DatasetSpec) -> _Columns:
    recs = _records(path)
    if not recs:
        raise NLIDataError(f"nli_data: {path} holds no records.")
    for i, r in recs:
        if not isinstance(r, dict):
            raise NLIDataError(
                f"nli_data: {path}, record {i} is a {type(r).__name__}; expected an object."
            )
    fs = _choose(spec, list(recs[0][1]), path)
    cols: list[list[Any]] = [[], [], []]
    for i, r in recs:
        missing = [f for f in fs if f not in r]
        if missing:
            raise NLIDataError(
                f"nli_data: {path}, record {i} lacks the field(s) {missing}; it has the fields "
                f"{sorted(r)}."
            )
        for c, f in zip(cols, fs, strict=True):
            c.append(r[f])
    return _Columns(fs, *cols)


def _read_delimited(path: pathlib.Path, spec: DatasetSpec) -> _Columns:
    tsv = path.suffix == ".tsv"
    # GLUE's and SNLI's TSVs hold unbalanced quotes: tab-separated files are read unquoted
    kw: dict[str, Any] = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if tsv else {}
    with path.open(encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f, **kw))
    if not rows:
        raise NLIDataError(f"nli_data: {path} is empty.")
    header = rows[0]
    matches = any(set(fs) <= set(header) for fs in spec.fields)
    if not matches and tsv and spec.headerless is not None and len(header) == len(spec.headerless):
        fs, idx, body, first = spec.headerless, [0, 1, 2], rows, 1
    else:
        fs = _choose(spec, header, path)
        idx, body, first = [header.index(f) for f in fs], rows[1:], 2
    cols: list[list[Any]] = [[], [], []]
    for n, row in enumerate(body, first):
        if not row:
            continue
        if len(row) <= max(idx):
            raise NLIDataError(
                f"nli_data: {path}, line {n} has {len(row)} column(s); the fields {list(fs)} "
                f"need {max(idx) + 1} (columns: {header if first == 2 else list(fs)})."
            )
        for c, k in zip(cols, idx, strict=True):
            c.append(row[k])
    return _Columns(fs, *cols)


_READERS = {
    ".parquet": _read_parquet,
    ".jsonl": _read_json,
    ".json": _read_json,
    ".csv": _read_delimited,
    ".tsv": _read_delimited,
}


def _label_key(v: Any) -> int | str | None:
    if isinstance(v, bool) or v is None:
        return None if v is None else str(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        s = v.strip()
        return int(s) if re.fullmatch(r"-?\d+", s) else s.lower()
    return repr(v)


def read_split(
    data_dir: str | pathlib.Path, name: str, stems: Sequence[str]
) -> tuple[tk.Split, list[pathlib.Path], int] | None:
    """The labelled examples of the first of ``stems`` found for dataset ``name``.

    Returns:
      ``(split, files, dropped)``: a ``tasks.Split`` whose texts are ``(premise, hypothesis)``
      pairs and whose labels are classes of :data:`LABELS`, the files read, and how many rows
      had no gold label (dropped). None if no stem has a file.

    Raises:
      NLIDataError: a missing field (named, with the fields the file has), a label value outside
        the dataset's table, a text that is not a string, a parquet file without pyarrow.
    """
    spec = dataset_spec(name)
    found = find_split(data_dir, name, stems)
    if found is None:
        return None
    files, _ = found
    pairs: list[tuple[str, str]] = []
    labels: list[int] = []
    dropped = 0
    accepted = sorted(map(str, spec.labels))
    for path in files:
        cols = _READERS[path.suffix](path, spec)
        for i, (p, h, y) in enumerate(zip(cols.premise, cols.hypothesis, cols.label, strict=True)):
            key = _label_key(y)
            if key not in spec.labels:
                raise NLIDataError(
                    f"nli_data: {path}, example {i + 1}: {cols.fields.label}={y!r} is not a "
                    f"{spec.name} label; expected one of {accepted}."
                )
            cls = spec.labels[key]
            if cls is None:
                dropped += 1
                continue
            for field, t in ((cols.fields.premise, p), (cols.fields.hypothesis, h)):
                if not isinstance(t, str):
                    raise NLIDataError(
                        f"nli_data: {path}, example {i + 1}: {field}={t!r} is not a string."
                    )
            pairs.append((p, h))
            labels.append(cls)
    return tk.Split(tuple(pairs), np.asarray(labels, np.int32)), files, dropped



def check_data(data_dir: str | pathlib.Path, names: Sequence[str] = NAMES) -> None:
    """Fail early, before any model is loaded, if a dataset's files are missing or unreadable.

    Checks that every dataset of ``names`` has train and validation files and, where a parquet
    file is among them, that pyarrow is installed. (Fields and labels are checked when the
    files are read.)

    Raises:
      MissingFileError: ``data_dir`` or a dataset's folder or split is missing.
      NLIDataError: an unknown dataset, a split stored twice, parquet without pyarrow.
    """
    d = pathlib.Path(data_dir)
    if not d.is_dir():
        raise MissingFileError(
            f"nli_data: the data folder {d} does not exist; it holds one folder per dataset "
            f"({', '.join(NAMES)})."
        )
    for name in names:
        spec = dataset_spec(name)
        for role, stems in (("train", ("train",)), ("validation", spec.validation)):
            found = find_split(d, name, stems)
            if found is None:
                raise MissingFileError(
                    f"nli_data: dataset {name!r} has no {role} split in {d / name}: expected "
                    f"{' or '.join(stems)} as a {'/'.join(FORMATS)} file or <stem>-*.parquet "
                    "shards."
                )
            parquet = [p for p in found[0] if p.suffix == ".parquet"]
            if parquet:
                _pyarrow_parquet(parquet[0])
