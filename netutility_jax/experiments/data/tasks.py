"""Text classification tasks for the LoRA-merging experiment, from real labelled data.

The machines this project runs on reach no network but the package registries, so
every built-in task is built from data that Debian packages ship. Install them with
(as root; R itself comes along as a dependency, but is never run)::

    apt-get install -y --no-install-recommends r-cran-dslabs r-cran-janeaustenr \\
        r-cran-modeldata r-cran-tidytext wordnet-base

The R packages keep their data sets in R lazy-load databases
(``<R library>/<package>/data/Rdata.rdx`` + ``Rdata.rdb``), read by a small reader of R's
XDR serialization format (:mod:`rdata_reader`: no code is ever evaluated and nothing is
unpickled); the WordNet tasks read ``/usr/share/wordnet/data.*``. :mod:`task_sources`
declares the built-in tasks and reads their rows; this module cleans, splits and loads them.

Built-in tasks (sizes for the defaults ``max_train=2000, n_val=200, n_test=1000``)
======================================================================================

Every task also has one short description per label (``TaskInfo.label_texts``): the base
model's embeddings of these are the task's frozen zero-shot head in the built-in experiment.

==================  =============================================  ===============================================  ==========================================  ==================
name                source (Debian package: file, object)          text                                             labels                                      train / val / test
==================  =============================================  ===============================================  ==========================================  ==================
austen_novel        r-cran-janeaustenr: data/Rdata.rdb, objects    a passage of two consecutive lines from one      Emma, Mansfield Park, Northanger Abbey,     1998 / 204 / 1002
                    emma, mansfieldpark, northangerabbey,          paragraph of a novel (passages of >= 8 words)    Persuasion, Pride and Prejudice, Sense
                    persuasion, prideprejudice, sensesensibility                                                    and Sensibility
tweet_source        r-cran-dslabs: data/Rdata.rdb, trump_tweets    a tweet from @realDonaldTrump, 2015-06-16 to     Android, iPhone                             2000 / 200 / 1000
                                                                   2016-11-08 (campaign), HTML entities decoded
word_sentiment      r-cran-tidytext: data/Rdata.rdb, sentiments    an English word of the Bing Liu opinion lexicon  negative, positive                          2000 / 200 / 1000
                    (the Bing lexicon)                             (words listed with both labels are dropped)
word_pos            r-cran-tidytext: data/Rdata.rdb,               a lower-case English word (Moby part-of-speech   adjective, adverb, noun, verb               2000 / 200 / 1000
                    parts_of_speech                                list) all of whose entries map to one coarse
                                                                   class: Noun/Plural -> noun, the three Verb
                                                                   tags -> verb, Adjective, Adverb
movie_genre         r-cran-dslabs: data/Rdata.rdb, movielens       a film title (", The" moved to the front) whose  Action, Comedy, Documentary, Drama, Horror   865 / 200 / 1000
                                                                   MovieLens genres contain exactly one of the
                                                                   five labels (other genres may also be listed)
review_sentiment    r-cran-modeldata: data/Rdata.rdb,              an Amazon fine-food review (``<br />`` removed;  great (5 stars), other (1-4 stars)          2000 / 200 / 1000
                    training_data + testing_data                   often longer than 128 tokens, truncate it)
                    (small_fine_foods)
wordnet_supersense  wordnet-base: /usr/share/wordnet/data.noun     the definition of a WordNet 3.0 noun synset      animal, artifact, food, location, person,   1998 / 204 / 1002
                                                                   (its gloss without the quoted examples)          plant
verb_supersense     wordnet-base: /usr/share/wordnet/data.verb     the definition of a WordNet 3.0 verb synset      change, communication, contact, motion,     1998 / 204 / 1002
                                                                   (its gloss without the quoted examples)          possession, social
word_relation       wordnet-base: /usr/share/wordnet/data.{noun,   two one-word lemmas ``"first ; second"``: a      antonym, hypernym, part, synonym            2000 / 200 / 1000
                    verb,adj,adv}: synsets and pointers            synset's first two lemmas (synonym), a ``!``
                                                                   pointer (antonym), a noun or verb and its
                                                                   direct ``@`` hypernym, a part and its whole
                                                                   (``%p``); the pair-input task
==================  =============================================  ===============================================  ==========================================  ==================

How a task is built and split
-----------------------------
1. The source rows are turned into ``(text, label)`` pairs; whitespace is collapsed,
   empty texts are dropped, a text that occurs with two different labels is dropped,
   and duplicates are merged. The pairs are sorted by text (a stable, machine-
   independent order that does not depend on the package's row order).
2. Built-in tasks are balanced: with ``k`` labels, validation and test get
   ``ceil(n / k)`` examples of every label (``n`` = ``n_val``, ``n_test``: at least ``n``
   in all) and train ``max_train // k``; when the rarest label has too few examples the
   train split gets what is left after validation and test (``movie_genre``: 173 per
   label).
3. Per label, a permutation drawn from a PCG64 stream (numpy's default bit generator)
   seeded by ``SeedSequence([seed, crc32(task name), label index])`` picks validation
   examples first, then test, then train, so changing ``max_train`` never changes the
   validation or test split. Raw bit-generator output (``random_raw``) is used, whose
   stream numpy keeps stable across versions and machines. Each split is then shuffled
   (same construction) so labels are interleaved.

User tasks (``--task NAME=PATH.csv``) come from a CSV file with a header naming at
least the columns ``text`` and ``label``; see :func:`load_csv_task`. They are split
per label in proportion (stratified), not balanced.
"""

from __future__ import annotations

import csv
import functools
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np

from ...errors import InputError
from .rdata_reader import read_r_lazyload as read_r_lazyload
from .rdata_reader import read_r_serialized as read_r_serialized
from .task_sources import APT_INSTALL_COMMAND as APT_INSTALL_COMMAND
from .task_sources import APT_PACKAGES as APT_PACKAGES
from .task_sources import BUILTIN_TASKS as BUILTIN_TASKS
from .task_sources import PAIR_SEP as PAIR_SEP
from .task_sources import TASK_INFO as TASK_INFO
from .task_sources import TaskDataMissingError as TaskDataMissingError
from .task_sources import TaskInfo as TaskInfo
from .task_sources import clean, task_info
from .task_sources import describe as describe

__all__ = [
    "APT_INSTALL_COMMAND",
    "APT_PACKAGES",
    "BUILTIN_TASKS",
    "DEFAULT_MAX_TRAIN",
    "DEFAULT_N_TEST",
    "DEFAULT_N_VAL",
    "PAIR_SEP",
    "TASK_INFO",
    "Split",
    "Task",
    "TaskDataError",
    "TaskDataMissingError",
    "TaskInfo",
    "data_available",
    "describe",
    "load_csv_task",
    "load_task",
    "load_task_arg",
    "load_tasks",
    "parse_task_arg",
    "read_r_lazyload",
    "read_r_serialized",
]

#: Directories searched, in order, for ``<package>/data/Rdata.rdx``.
R_LIBRARY_DIRS: tuple[str, ...] = (
    "/usr/lib/R/site-library",
    "/usr/local/lib/R/site-library",
    "/usr/lib/R/library",
)
#: Directories searched, in order, for WordNet's ``data.noun``.
WORDNET_DIRS: tuple[str, ...] = ("/usr/share/wordnet",)

DEFAULT_MAX_TRAIN = 2000
DEFAULT_N_VAL = 200
DEFAULT_N_TEST = 1000


class TaskDataError(InputError):
    """A task's data or arguments cannot make a usable task (bad CSV, bad sizes)."""


# --------------------------------------------------------------------------------------
# Tasks and splits.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Split:
    """Texts and their label ids (``int32``, indices into ``Task.labels``)."""

    texts: tuple[str, ...]
    labels: np.ndarray

    def __post_init__(self) -> None:
        labels = np.asarray(self.labels, dtype=np.int32).copy()
        labels.setflags(write=False)
        object.__setattr__(self, "labels", labels)
        object.__setattr__(self, "texts", tuple(self.texts))
        if labels.shape != (len(self.texts),):
            raise InputError(f"{len(self.texts)} texts but labels of shape {labels.shape}")

    def __len__(self) -> int:
        return len(self.texts)


@dataclass(frozen=True, eq=False)
class Task:
    """A text classification task with fixed train/validation/test splits.

    Attributes:
      name: task name.
      labels: label names; label id ``i`` is ``labels[i]``.
      train, val, test: the splits (disjoint).
      source: where the data comes from.
      label_texts: one short description per label; their base-model embeddings are the task's
        frozen zero-shot head (default: the label names).
      pair: each text is two words joined by :data:`PAIR_SEP`.
    """

    name: str
    labels: tuple[str, ...]
    train: Split
    val: Split
    test: Split
    source: str = ""
    label_texts: tuple[str, ...] = ()
    pair: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", tuple(self.labels))
        texts = tuple(self.label_texts) or self.labels
        if len(texts) != len(self.labels):
            raise TaskDataError(
                f"task {self.name!r}: {len(texts)} label texts for {len(self.labels)} labels; "
                "give one description per label"
            )
        object.__setattr__(self, "label_texts", texts)

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @property
    def splits(self) -> dict[str, Split]:
        return {"train": self.train, "val": self.val, "test": self.test}

    def describe(self) -> str:
        """A one-paragraph summary: source, labels and per-split label counts."""
        lines = [f"{self.name}: {self.num_labels} labels, source {self.source or '?'}"]
        for split_name, split in self.splits.items():
            counts = np.bincount(split.labels, minlength=self.num_labels)
            per_label = ", ".join(f"{lab}={c}" for lab, c in zip(self.labels, counts, strict=True))
            lines.append(f"  {split_name:5s} {len(split):5d}  ({per_label})")
        return "\n".join(lines)


def _permutation(n: int, seed: int, *keys: int) -> np.ndarray:
    """A permutation of ``range(n)`` that is the same on every machine and numpy version."""
    bits = np.random.PCG64(np.random.SeedSequence([seed, *keys])).random_raw(n)
    return np.argsort(bits, kind="stable")


def _name_key(name: str) -> int:
    return zlib.crc32(name.encode("utf-8"))


def _check_sizes(seed: int, max_train: int, n_val: int, n_test: int) -> None:
    for arg, value, low in (("seed", seed, 0), ("max_train", max_train, 1)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
            raise TaskDataError(f"{arg} must be an integer >= {low}, got {value!r}")
    for arg, value in (("n_val", n_val), ("n_test", n_test)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise TaskDataError(f"{arg} must be an integer >= 1, got {value!r}")


def _dedupe(rows: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """Clean texts, drop empty and ambiguous ones; texts per label, each sorted."""
    seen: dict[str, str | None] = {}
    for text, label in rows:
        text = clean(text)
        if text and label is not None:
            label = str(label)
            seen[text] = label if seen.get(text, label) == label else None
    by_label: dict[str, list[str]] = {}
    for text in sorted(seen):
        label = seen[text]
        if label is not None:
            by_label.setdefault(label, []).append(text)
    return by_label


def _assemble(
    name: str,
    labels: tuple[str, ...],
    parts: dict[str, list[tuple[str, int]]],
    seed: int,
    source: str,
    label_texts: tuple[str, ...] = (),
    pair: bool = False,
) -> Task:
    splits = {}
    for i, split_name in enumerate(("train", "val", "test")):
        items = parts[split_name]
        order = _permutation(len(items), seed, _name_key(name), 1_000_000 + i)
        splits[split_name] = Split(
            texts=tuple(items[j][0] for j in order),
            labels=np.array([items[j][1] for j in order], dtype=np.int32),
        )
    return Task(
        name=name, labels=labels, source=source, label_texts=label_texts, pair=pair, **splits
    )


def _balanced_split(
    name: str,
    labels: tuple[str, ...],
    by_label: Mapping[str, Sequence[str]],
    *,
    seed: int,
    max_train: int,
    n_val: int,
    n_test: int,
    source: str,
    label_texts: tuple[str, ...] = (),
    pair: bool = False,
) -> Task:
    k = len(labels)
    # at least n_val / n_test in all (a ceiling per label), at most max_train
    val_per, test_per = -(-n_val // k), -(-n_test // k)
    if max_train < k:
        raise TaskDataError(
            f"task {name!r} has {k} labels: max_train, n_val and n_test must each be >= {k}"
        )
    fewest = min(len(by_label.get(label, ())) for label in labels)
    train_per = min(max_train // k, fewest - val_per - test_per)
    if train_per < 1:
        raise TaskDataError(
            f"task {name!r}: the rarest label has {fewest} examples, too few for "
            f"{val_per} validation + {test_per} test + 1 train example per label"
        )
    parts = _pick(name, labels, by_label, [(val_per, test_per, train_per)] * k, seed)
    return _assemble(name, labels, parts, seed, source, label_texts, pair)


def _pick(
    name: str,
    labels: tuple[str, ...],
    by_label: Mapping[str, Sequence[str]],
    sizes: Sequence[tuple[int, int, int]],
    seed: int,
) -> dict[str, list[tuple[str, int]]]:
    """``(text, label index)`` per split: label ``i`` gives ``sizes[i]`` = (val, test, train)
    texts, in that order, of its seed-determined permutation."""
    parts: dict[str, list[tuple[str, int]]] = {"train": [], "val": [], "test": []}
    for index, label in enumerate(labels):
        val, test, train = sizes[index]
        texts = by_label[label]
        order = _permutation(len(texts), seed, _name_key(name), index)
        picked = [(texts[j], index) for j in order[: val + test + train]]
        parts["val"] += picked[:val]
        parts["test"] += picked[val : val + test]
        parts["train"] += picked[val + test :]
    return parts


@functools.lru_cache(maxsize=16)
def _cached_rows(
    name: str, r_dirs: tuple[str, ...], wn_dirs: tuple[str, ...]
) -> Mapping[str, tuple[str, ...]]:
    """A built-in task's texts per label, kept in memory (keyed by the data directories)."""
    info = TASK_INFO[name]
    by_label = _dedupe(info.rows(r_dirs, wn_dirs))
    unexpected = set(by_label) - set(info.labels)
    if unexpected:
        raise TaskDataError(f"task {name!r}: unexpected labels {sorted(unexpected)} in the data")
    return MappingProxyType({label: tuple(texts) for label, texts in by_label.items()})


def data_available(name: str) -> bool:
    """Whether the Debian data that built-in task ``name`` needs is installed."""
    info = task_info(name)
    if info.apt_package == "wordnet-base":
        return any((Path(d) / "data.noun").is_file() for d in WORDNET_DIRS)
    package = info.apt_package.removeprefix("r-cran-")
    return any(
        (Path(d) / package / "data" / "Rdata.rdx").is_file()
        and (Path(d) / package / "data" / "Rdata.rdb").is_file()
        for d in R_LIBRARY_DIRS
    )


def load_task(
    name: str,
    *,
    seed: int = 0,
    max_train: int = DEFAULT_MAX_TRAIN,
    n_val: int = DEFAULT_N_VAL,
    n_test: int = DEFAULT_N_TEST,
) -> Task:
    """Load built-in task ``name`` with balanced, seed-determined splits.

    Validation and test hold ``ceil(n / len(labels))`` examples of every label (``n`` being
    ``n_val`` or ``n_test``), train ``max_train // len(labels)``, fewer when the rarest label
    runs out. Raises :class:`TaskDataMissingError` (naming the ``apt-get install`` line) when
    the Debian data is not installed, ``KeyError`` for an unknown name.
    """
    info = task_info(name)
    _check_sizes(seed, max_train, n_val, n_test)
    by_label = _cached_rows(name, tuple(R_LIBRARY_DIRS), tuple(WORDNET_DIRS))
    return _balanced_split(
        name,
        info.labels,
        by_label,
        seed=seed,
        max_train=max_train,
        n_val=n_val,
        n_test=n_test,
        source=f"{info.source} (Debian package {info.apt_package})",
        label_texts=info.label_texts,
        pair=info.pair,
    )


def load_tasks(
    names: Iterable[str] | None = None,
    *,
    seed: int = 0,
    max_train: int = DEFAULT_MAX_TRAIN,
    n_val: int = DEFAULT_N_VAL,
    n_test: int = DEFAULT_N_TEST,
) -> list[Task]:
    """Load several tasks (all built-in ones by default).

    A name may also be ``NAME=PATH.csv`` for a task of your own (see
    :func:`load_task_arg`).
    """
    names = BUILTIN_TASKS if names is None else (names,) if isinstance(names, str) else tuple(names)
    if len(set(names)) != len(names):
        raise TaskDataError(f"task names repeat: {list(names)}")
    kwargs = {"seed": seed, "max_train": max_train, "n_val": n_val, "n_test": n_test}
    tasks = [load_task_arg(n, **kwargs) for n in names]
    task_names = [t.name for t in tasks]
    if len(set(task_names)) != len(task_names):
        raise TaskDataError(f"task names repeat: {task_names}")
    return tasks


# --------------------------------------------------------------------------------------
# User tasks from CSV files.
# --------------------------------------------------------------------------------------

_TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def parse_task_arg(arg: str) -> tuple[str, Path]:
    """Split a ``--task NAME=PATH.csv`` argument into ``(NAME, Path(PATH.csv))``."""
    name, sep, path = arg.partition("=")
    name, path = name.strip(), path.strip()
    if not sep or not path:
        raise TaskDataError(f"expected NAME=PATH.csv for a task of your own, got {arg!r}")
    if not _TASK_NAME.fullmatch(name):
        raise TaskDataError(
            f"task name {name!r} in {arg!r} must be letters, digits, '_', '.' or '-'"
        )
    if name in TASK_INFO:
        raise TaskDataError(f"task name {name!r} is a built-in task; choose another name")
    return name, Path(path)


def load_task_arg(
    arg: str,
    *,
    seed: int = 0,
    max_train: int = DEFAULT_MAX_TRAIN,
    n_val: int = DEFAULT_N_VAL,
    n_test: int = DEFAULT_N_TEST,
) -> Task:
    """Load ``arg``: a built-in task name, or ``NAME=PATH.csv`` for a CSV task."""
    kwargs = {"seed": seed, "max_train": max_train, "n_val": n_val, "n_test": n_test}
    if "=" in arg:
        name, path = parse_task_arg(arg)
        return load_csv_task(name, path, **kwargs)
    return load_task(arg, **kwargs)


def load_csv_task(
    name: str,
    path: str | Path,
    *,
    seed: int = 0,
    max_train: int = DEFAULT_MAX_TRAIN,
    n_val: int = DEFAULT_N_VAL,
    n_test: int = DEFAULT_N_TEST,
) -> Task:
    """Load a task of your own from a UTF-8 CSV file with columns ``text`` and ``label``.

    The header row must name both columns (others are ignored). Texts are cleaned and
    deduplicated like the built-in tasks'; texts given two labels are dropped. Labels
    are strings and sorted, so label id ``i`` is the ``i``-th label in sorted order.
    Splits are stratified: every label keeps its share, with about ``n_val`` validation
    and ``n_test`` test examples in all (at most 15% and 25% of each label, and at least
    one per label in each split), the rest in train, scaled down to at most
    ``max_train``. Every label needs at least 3 examples.
    """
    _check_sizes(seed, max_train, n_val, n_test)
    path = Path(path)
    rows = _read_csv_rows(name, path)
    by_label = _dedupe(rows)
    if not by_label:
        raise TaskDataError(f"task {name!r}: {path} has no rows with a text and a label")
    labels = tuple(sorted(by_label))
    if len(labels) < 2:
        raise TaskDataError(
            f"task {name!r}: {path} has fewer than 2 labels ({list(labels)}); "
            "a classification task needs at least 2"
        )
    too_few = {lab: len(by_label[lab]) for lab in labels if len(by_label[lab]) < 3}
    if too_few:
        raise TaskDataError(
            f"task {name!r}: label(s) with too few examples to split: {too_few}; each label "
            "needs at least 3 distinct texts (one each for train, validation and test)"
        )
    return _stratified_split(
        name,
        labels,
        by_label,
        seed=seed,
        max_train=max_train,
        n_val=n_val,
        n_test=n_test,
        source=str(path),
    )


def _read_csv_rows(name: str, path: Path) -> list[tuple[str, str | None]]:
    """The ``(text, label)`` rows of a task CSV, refusing what would silently lose rows.

    Refused with :class:`TaskDataError` naming the task, the file and the line: a path that is
    not a readable file, a file that is not UTF-8, a missing or repeated header column, and a
    quote that is never closed (Python's csv module would otherwise read the rest of the file
    into one field).
    """
    where = f"task {name!r}: {path}"
    if path.is_dir():
        raise TaskDataError(f"{where} is a directory; give the CSV file inside it")
    if not path.is_file():
        raise TaskDataError(f"task {name!r}: CSV file {path} does not exist")
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f, strict=True)
            header = next(reader, None)
            if not header or not any(h.strip() for h in header):
                raise TaskDataError(f"{where} is empty (expected a header text,label)")
            names = [h.strip() for h in header]
            repeated = sorted({h for h in names if h and names.count(h) > 1})
            if repeated:
                raise TaskDataError(
                    f"{where}: the header names column(s) {', '.join(map(repr, repeated))} more "
                    f"than once ({header}); each column name must be unique"
                )
            missing = [c for c in ("text", "label") if c not in names]
            if missing:
                raise TaskDataError(
                    f"{where} has no column {' or '.join(map(repr, missing))} "
                    f"(header: {header}); expected columns text,label"
                )
            i_text, i_label = names.index("text"), names.index("label")
            rows: list[tuple[str, str | None]] = []
            start = reader.line_num + 1
            try:
                for row in reader:
                    if row:
                        text = row[i_text] if i_text < len(row) else ""
                        label = row[i_label] if i_label < len(row) else ""
                        rows.append((text or "", clean(label) or None))
                    start = reader.line_num + 1
            except csv.Error as e:
                raise TaskDataError(
                    f"{where}: line {start}: {e} (a quote opened on line {start} is never "
                    "closed?); fix the quoting of that row"
                ) from None
    except UnicodeDecodeError as e:
        raise TaskDataError(
            f"{where} is not UTF-8 (byte {e.object[e.start : e.start + 1]!r} at offset "
            f"{e.start}); save it as UTF-8"
        ) from None
    except PermissionError:
        raise TaskDataError(f"{where} cannot be read (permission denied)") from None
    return rows


def _stratified_split(
    name: str,
    labels: tuple[str, ...],
    by_label: dict[str, list[str]],
    *,
    seed: int,
    max_train: int,
    n_val: int,
    n_test: int,
    source: str,
) -> Task:
    total = sum(len(by_label[lab]) for lab in labels)
    val_frac, test_frac = min(0.15, n_val / total), min(0.25, n_test / total)
    counts = {}
    for lab in labels:
        n = len(by_label[lab])
        val, test = max(1, int(n * val_frac)), max(1, int(n * test_frac))
        counts[lab] = (val, test, n - val - test)
    train_total = sum(c[2] for c in counts.values())
    scale = min(1.0, max_train / train_total)
    sizes = [(val, test, max(1, int(train * scale))) for val, test, train in counts.values()]
    return _assemble(name, labels, _pick(name, labels, by_label, sizes, seed), seed, source)
