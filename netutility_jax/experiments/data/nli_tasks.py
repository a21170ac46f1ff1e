"""The NLI suite's tasks: each dataset of :mod:`nli_data` split into train, validation and test.

**Splits.** The paper does not say which splits it validated and tested on, so the protocol is
ours (:func:`dataset_splits`): where the dataset has a test file with labels (SNLI, SICK,
SciTail), validation is the official validation split and test the official test split; where
the test labels are hidden (GLUE's MNLI, QNLI, RTE: every test label is -1) or there is no test
file, **test is the official validation split** (MNLI: ``validation_matched``) and validation is
a held-out part of train, as many examples as the official validation split but at most a tenth
of train, drawn with a fixed seed (:data:`SPLIT_SEED` and the dataset's name). A preset's
``max_train``, ``n_val`` and ``n_test`` then cap each split by a seeded draw that keeps file
order (:data:`ALL`, 0: every example).
"""

from __future__ import annotations

import pathlib
import zlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ...errors import MissingFileError
from . import tasks as tk
from .nli_data import FORMATS, LABELS, NAMES, NLIDataError, dataset_spec, read_split

__all__ = [
    "ALL",
    "SPLIT_SEED",
    "NLISplits",
    "dataset_splits",
    "load_task",
    "load_tasks",
]

#: A split size meaning "every example".
ALL = 0
#: Seed of the held-out validation draws and of the size caps (``runner.SPLIT_SEED``).
SPLIT_SEED = 0


class NLISplits(NamedTuple):
    """A dataset's three splits (before any size cap) and where they came from.

    Attributes:
      train, val, test: ``tasks.Split`` of ``(premise, hypothesis)`` pairs.
      sources: ``{"train" | "val" | "test": description}`` (files, or the held-out draw).
      protocol: ``"official"`` (validation and test files) or ``"validation_as_test"`` (test is
        the official validation split; validation is held out of train).
    """

    train: tk.Split
    val: tk.Split
    test: tk.Split
    sources: dict[str, str]
    protocol: str


def _permutation(n: int, seed: int, name: str, stream: int) -> np.ndarray:
    bits = np.random.PCG64(
        np.random.SeedSequence([seed, zlib.crc32(name.encode()), stream])
    ).random_raw(n)
    return np.argsort(bits, kind="stable")


def _take(split: tk.Split, idx: np.ndarray) -> tk.Split:
    idx = np.sort(np.asarray(idx, np.int64))
    return tk.Split(tuple(split.texts[i] for i in idx), split.labels[idx])


def _names(files: Sequence[pathlib.Path]) -> str:
    return ", ".join(str(f) for f in files)


def dataset_splits(data_dir: str | pathlib.Path, name: str, *, seed: int = SPLIT_SEED) -> NLISplits:
    """Train, validation and test of dataset ``name`` under this module's protocol (docstring).

    Raises:
      MissingFileError: no train or no validation file (the message names where it looked).
      NLIDataError: a file that cannot be read (see :func:`read_split`), a split left empty.
    """
    spec = dataset_spec(name)
    root = pathlib.Path(data_dir) / name

    def need(role: str, stems: Sequence[str]) -> tuple[tk.Split, list[pathlib.Path], int]:
        got = read_split(data_dir, name, stems)
        if got is None:
            raise MissingFileError(
                f"nli_data: dataset {name!r} has no {role} split in {root}: expected "
                f"{' or '.join(stems)} as a {'/'.join(FORMATS)} file or <stem>-*.parquet shards "
                f"(here or in a subfolder such as {', '.join(spec.configs) or 'data'})."
            )
        if len(got[0]) == 0:
            raise NLIDataError(
                f"nli_data: the {role} split of {name!r} ({_names(got[1])}) has no example with "
                f"a gold label ({got[2]} dropped)."
            )
        return got

    train, train_files, _ = need("train", ("train",))
    val, val_files, _ = need("validation", spec.validation)
    test_got = read_split(data_dir, name, spec.test)
    if test_got is not None and len(test_got[0]) > 0:
        test, test_files, _ = test_got
        return NLISplits(
            train, val, test,
            {"train": _names(train_files), "val": _names(val_files), "test": _names(test_files)},
            "official",
        )  # fmt: skip
    n_val = min(len(val), len(train) // 10)
    if n_val < 1:
        raise NLIDataError(
            f"nli_data: {name!r} has no labelled test split and {len(train)} training examples, "
            "too few to hold a validation split out of train."
        )
    perm = _permutation(len(train), seed, name, 0)
    why = "no test file" if test_got is None else "its test labels are hidden"
    return NLISplits(
        _take(train, perm[n_val:]),
        _take(train, perm[:n_val]),
        val,
        {
            "train": f"{_names(train_files)} less the held-out validation examples",
            "val": f"{n_val} examples held out of {_names(train_files)} (seed {seed})",
            "test": f"{_names(val_files)} (the official validation split; {why})",
        },
        "validation_as_test",
    )


def _cap(split: tk.Split, n: int, seed: int, name: str, stream: int) -> tk.Split:
    if not n or n >= len(split):
        return split
    return _take(split, _permutation(len(split), seed, name, stream)[:n])


def load_task(
    data_dir: str | pathlib.Path,
    name: str,
    *,
    seed: int = SPLIT_SEED,
    max_train: int = ALL,
    n_val: int = ALL,
    n_test: int = ALL,
) -> tk.Task:
    """Dataset ``name`` as a ``tasks.Task`` in the unified label space.

    The task's ``labels`` are :data:`LABELS`; its ``label_texts`` name each class as the dataset
    does, :data:`UNUSED` for a class it never uses (its mask); its texts are ``(premise,
    hypothesis)`` pairs (``pair=True``). Splits follow :func:`dataset_splits`, each then capped
    to ``max_train`` / ``n_val`` / ``n_test`` examples by a seeded draw (:data:`ALL`: no cap).

    Raises:
      MissingFileError, NLIDataError: as :func:`dataset_splits`; a negative size.
    """
    for arg, v in (("max_train", max_train), ("n_val", n_val), ("n_test", n_test)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise NLIDataError(
                f"nli_data.load_task: {arg}={v!r}; expected an integer >= 0 (0: every example)."
            )
    spec = dataset_spec(name)
    s = dataset_splits(data_dir, name, seed=seed)
    source = (
        f"{spec.title} ({spec.hub}); train: {s.sources['train']}; validation: "
        f"{s.sources['val']}; test: {s.sources['test']}"
    )
    return tk.Task(
        name,
        LABELS,
        _cap(s.train, max_train, seed, name, 1),
        _cap(s.val, n_val, seed, name, 2),
        _cap(s.test, n_test, seed, name, 3),
        source=source,
        label_texts=spec.label_texts,
        pair=True,
    )


def load_tasks(
    data_dir: str | pathlib.Path,
    names: Sequence[str] = NAMES,
    *,
    seed: int = SPLIT_SEED,
    max_train: int = ALL,
    n_val: int = ALL,
    n_test: int = ALL,
) -> list[tk.Task]:
    """:func:`load_task` for each of ``names`` (default the paper's six)."""
    if len(set(names)) != len(names):
        raise NLIDataError(f"nli_data.load_tasks: a dataset is named twice in {list(names)}.")
    return [
        load_task(data_dir, n, seed=seed, max_train=max_train, n_val=n_val, n_test=n_test)
        for n in names
    ]
