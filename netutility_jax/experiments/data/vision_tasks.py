"""The vision suite's tasks: each dataset of :mod:`vision_data` split into validation and test.

**Validation split** (:func:`holdout`). A dataset whose data has a validation split uses it
(DTD, EuroSAT and RESISC45 have one in KnOTS' data). For the others KnOTS (and the Core Space
code the paper builds on) holds out part of the **test** split: a stored permutation of the test
set (``dataset/shuffled_idxs/<dataset>_shuffled_idxs.pt``), its first ``int(0.2 n)`` indices
validation, the rest test (:data:`KNOTS_VAL_FRACTION`). This is the default here
(``holdout="test"``). With an index file (below) the split is KnOTS' exactly; without one the
permutation is ours: drawn from PCG64's raw output seeded by ``SeedSequence([seed, crc32(name)])``
(the same on every machine and numpy version). ``holdout="train"`` is task-vectors' protocol
instead (Ilharco et al.: ``min(int(0.1 n_train), 5000)`` training images, seeded; our
permutation, not torch's ``random_split``), for data with a train split.

**Index files** (KnOTS' permutations, converted): ``DATA/<dataset>/shuffled_idxs.npy``,
``.json`` or ``.txt``: a permutation of ``range(n_test)`` (a 1-d integer array; a JSON list; or
whitespace-separated integers), indices into the test split in reading order (image folders:
the order above; parquet: row order). Alternatively a JSON object ``{"val": [...], "test":
[...]}`` of disjoint test-split indices gives both sets explicitly. KnOTS ships ``.pt`` files
(``torch.save`` of a tensor), which are not unpickled here; convert one with
``python -c "import numpy, torch; numpy.save('shuffled_idxs.npy', torch.load('x.pt').numpy())"``.

**Sizes.** ``n_val`` / ``n_test`` (a preset's) keep a seeded uniform subset of that many
examples (ours; None keeps every example, as the paper does).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import InputError, MissingFileError
from .vision_data import (
    SPLIT_NAMES,
    DatasetSpec,
    Split,
    VisionDataError,
    class_name,
    dataset_dir,
    dataset_spec,
    find_split,
    read_split,
)

__all__ = [
    "KNOTS_VAL_FRACTION",
    "TRAIN_VAL_FRACTION",
    "TRAIN_VAL_MAX",
    "VisionTask",
    "holdout",
    "load_task",
    "read_index_file",
    "subset",
]

#: KnOTS' validation share of the test split (``val_fraction`` of its vision configs).
KNOTS_VAL_FRACTION = 0.2
#: task-vectors' validation share of the train split, and its cap (``get_dataset``'s defaults).
TRAIN_VAL_FRACTION = 0.1
TRAIN_VAL_MAX = 5000
_HOLDOUTS = ("test", "train")


def _permutation(n: int, seed: int, *keys: int) -> np.ndarray:
    """A permutation of ``range(n)``, the same on every machine and numpy version."""
    bits = np.random.PCG64(np.random.SeedSequence([seed, *keys])).random_raw(n)
    return np.argsort(bits, kind="stable")


def _key(name: str) -> int:
    return zlib.crc32(name.encode())


def read_index_file(path: str | os.PathLike, n: int) -> tuple[np.ndarray, np.ndarray] | np.ndarray:
    """A KnOTS-style index file of a test split of ``n`` examples (see the module doc).

    Returns:
      a permutation of ``range(n)`` ``(n,)`` int64, or ``(val, test)`` index arrays from a JSON
      ``{"val": [...], "test": [...]}``.

    Raises:
      VisionDataError: unreadable; not a permutation of ``range(n)``; ``val`` and ``test`` not
        disjoint or out of range.
    """
    p = pathlib.Path(path)
    try:
        if p.suffix == ".npy":
            raw: Any = np.load(p, allow_pickle=False)
        elif p.suffix == ".json":
            raw = json.loads(p.read_text())
        else:
            raw = [int(t) for t in p.read_text().split()]
    except (OSError, ValueError) as e:
        raise VisionDataError(f"index file {p}: cannot read it ({e})") from None

    def ints(x: Any, what: str) -> np.ndarray:
        a = np.asarray(x)
        if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
            raise VisionDataError(f"index file {p}: {what} is not a 1-d list of integers")
        return a.astype(np.int64)

    if isinstance(raw, dict):
        if set(raw) != {"val", "test"}:
            raise VisionDataError(
                f"index file {p}: keys {sorted(raw)}; expected exactly 'val' and 'test'"
            )
        val, test = ints(raw["val"], "val"), ints(raw["test"], "test")
        both = np.concatenate([val, test])
        if both.size and (both.min() < 0 or both.max() >= n):
            raise VisionDataError(f"index file {p}: indices outside the test split's range(0, {n})")
        if len(np.unique(both)) != len(both):
            raise VisionDataError(f"index file {p}: 'val' and 'test' share or repeat indices")
        return val, test
    perm = ints(raw, "the permutation")
    if len(perm) != n or not np.array_equal(np.sort(perm), np.arange(n)):
        raise VisionDataError(
            f"index file {p}: holds {len(perm)} indices but is not a permutation of the test "
            f"split's {n} examples; it belongs to data in another order or of another size"
        )
    return perm


def holdout(
    n: int, *, fraction: float, cap: int | None = None, seed: int = 0, name: str = "",
    permutation: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Split ``range(n)`` into a held-out validation part and the rest (KnOTS' rule).

    ``val = perm[:k]``, ``rest = perm[k:]`` with ``k = int(n * fraction)`` (at most ``cap``),
    ``perm`` the given permutation (KnOTS' index file) or ours (PCG64 raw output seeded by
    ``SeedSequence([seed, crc32(name)])``).

    Returns:
      ``(val, rest)`` int64 index arrays, disjoint, together ``range(n)``.

    Example:
      >>> val, rest = holdout(10, fraction=0.2, name="mnist")
      >>> len(val), len(rest), sorted([*val, *rest]) == list(range(10))
      (2, 8, True)
    """
    perm = _permutation(n, seed, _key(name)) if permutation is None else np.asarray(permutation)
    k = int(n * fraction)
    k = k if cap is None else min(k, cap)
    return perm[:k].astype(np.int64), perm[k:].astype(np.int64)


def subset(split: Split, n: int | None, *, seed: int, name: str, part: str) -> Split:
    """At most ``n`` examples of ``split``: a seeded uniform subset in the split's order (ours);
    the split itself when ``n`` is None or not smaller."""
    if n is None or n >= len(split):
        return split
    keep = np.sort(_permutation(len(split), seed, _key(name), _key(part))[:n])
    return split.take(keep)


# ------------------------------------------------------------------------------------ tasks


@dataclasses.dataclass(frozen=True, eq=False)
class VisionTask:
    """One dataset of the vision suite, split (the harness's task: ``name``, ``labels``,
    ``label_texts``, ``pair``, ``source``, ``train``, ``val``, ``test``).

    Attributes:
      name: the dataset.
      labels: class names in label order.
      label_texts: each class's first prompt (what the report shows).
      templates: the prompt templates (``{c}`` the class name).
      source: where the data and the validation split came from.
      train: not used (the adapters are given): empty, or what is left of the train split.
      val, test: the evaluation splits.
      holdout: how validation was made: ``"val split"``, ``"knots index file"``,
        ``"test 20% (ours)"``, ``"train 10% (ours)"``.
    """

    name: str
    labels: tuple[str, ...]
    label_texts: tuple[str, ...]
    templates: tuple[str, ...]
    source: str
    train: Split
    val: Split
    test: Split
    holdout: str
    pair: bool = False

    def prompts(self) -> list[list[str]]:
        """Every class's prompts, one per template."""
        return [[t.replace("{c}", c) for t in self.templates] for c in self.labels]


def _lines(path: pathlib.Path) -> tuple[str, ...] | None:
    if not path.is_file():
        return None
    lines = tuple(s.strip() for s in path.read_text().splitlines() if s.strip())
    if not lines:
        raise VisionDataError(f"{path}: empty; one entry per line")
    return lines


def _index_file(ds_dir: pathlib.Path) -> pathlib.Path | None:
    found = [ds_dir / f"shuffled_idxs{ext}" for ext in (".npy", ".json", ".txt")]
    found = [p for p in found if p.is_file()]
    if len(found) > 1:
        raise VisionDataError(f"{ds_dir}: several index files {[p.name for p in found]}; keep one")
    if not found and (ds_dir / "shuffled_idxs.pt").is_file():
        raise VisionDataError(
            f"{ds_dir / 'shuffled_idxs.pt'}: KnOTS' torch file is not unpickled here; convert "
            "it: python -c \"import numpy, torch; numpy.save('shuffled_idxs.npy', "
            "torch.load('shuffled_idxs.pt').numpy())\""
        )
    return found[0] if found else None


def _classes(spec: DatasetSpec, ds_dir: pathlib.Path, splits: Sequence[Split]) -> tuple[str, ...]:
    """The class names: ``classnames.txt``, the spec's, else from the data; checked against
    the data's class count."""
    keys = next((s.classes for s in splits if s.classes is not None), None)
    for s in splits:
        if keys is not None and s.classes is not None and len(s.classes) != len(keys):
            raise VisionDataError(
                f"{ds_dir}: the splits have {len(keys)} and {len(s.classes)} classes; every "
                "split needs the same class folders"
            )
        if keys is not None and s.classes is not None and s.classes != keys:
            raise VisionDataError(
                f"{ds_dir}: the splits' classes differ ({_diff(keys, s.classes)}); every split "
                "needs the same class folders"
            )
    top = max(int(s.labels.max()) + 1 for s in splits if len(s))
    names = _lines(ds_dir / "classnames.txt") or spec.classes
    if names is None:
        if keys is None:
            raise VisionDataError(
                f"{ds_dir}: the data names no classes (parquet without ClassLabel names); "
                "write classnames.txt (one name per line, in label order)"
            )
        names = tuple(class_name(k, flat_index=spec.name == "sun397") for k in keys)
    n_data = len(keys) if keys is not None else top  # (labels alone: at least the largest + 1)
    if (keys is not None and len(names) != n_data) or top > len(names):
        raise VisionDataError(
            f"{ds_dir}: the data has {n_data} classes but {len(names)} class names are "
            f"declared for {spec.name!r}; the class folders (or labels) do not match the dataset"
        )
    return tuple(names)


def _diff(a: Sequence[str], b: Sequence[str]) -> str:
    i = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    return f"{a[i]!r} vs {b[i]!r}"


def load_task(
    data_dir: str | os.PathLike,
    name: str,
    *,
    n_val: int | None = None,
    n_test: int | None = None,
    holdout_from: str = "test",
    seed: int = 0,
) -> VisionTask:
    """Dataset ``name`` from ``DATA/<name>``, with its validation split (module doc).

    Args:
      data_dir: ``--data-dir``.
      name: a key of :data:`DATASETS` or a dataset of your own.
      n_val, n_test: most examples kept (None: all).
      holdout_from: where validation comes from when the data has no validation split:
        ``"test"`` (KnOTS: 20% of test, the index file if there is one) or ``"train"``
        (task-vectors: 10% of train, at most 5000).
      seed: of our permutations and subsets (the data splits, not the merges).

    Raises:
      MissingFileError: no dataset folder, or no test split.
      VisionDataError: unreadable data, classes that do not match, a bad index file, parquet
        without pyarrow, ``holdout_from="train"`` without a train split.
    """
    if holdout_from not in _HOLDOUTS:
        raise InputError(f"load_task: holdout_from={holdout_from!r}; expected one of {_HOLDOUTS}")
    spec = dataset_spec(name)
    d = dataset_dir(data_dir, name)
    found = {s: find_split(d, s) for s in SPLIT_NAMES}
    if found["test"] is None:
        raise MissingFileError(
            f"{d}: no test split (expected {d}/test/<class>/*.jpg or {d}/test-*.parquet)"
        )
    test = read_split(found["test"])
    if found["val"] is not None:
        val = read_split(found["val"])
        how = "val split"
        splits = [val, test]
    elif holdout_from == "test":
        idx = _index_file(d)
        if idx is None:
            v, t = holdout(len(test), fraction=KNOTS_VAL_FRACTION, seed=seed, name=name)
            how = f"test {KNOTS_VAL_FRACTION:.0%} (ours)"
        else:
            got = read_index_file(idx, len(test))
            v, t = (
                got
                if isinstance(got, tuple)
                else holdout(len(test), fraction=KNOTS_VAL_FRACTION, permutation=got)
            )
            how = "knots index file"
        val, test = test.take(v), test.take(t)
        splits = [val, test]
    else:
        if found["train"] is None:
            raise VisionDataError(
                f"{d}: holdout from train needs a train split ({d}/train/ or train-*.parquet)"
            )
        train = read_split(found["train"])
        v, _ = holdout(
            len(train), fraction=TRAIN_VAL_FRACTION, cap=TRAIN_VAL_MAX, seed=seed, name=name
        )
        val = train.take(np.sort(v))
        how = f"train {TRAIN_VAL_FRACTION:.0%} (ours)"
        splits = [val, test]
    if not len(val) or not len(test):
        raise VisionDataError(
            f"{d}: {len(val)} validation and {len(test)} test examples; both need at least one"
        )
    labels = _classes(spec, d, splits)
    templates = _lines(d / "templates.txt") or spec.templates
    bad = [t for t in templates if "{c}" not in t]
    if bad:
        raise VisionDataError(f"{d}: template {bad[0]!r} has no {{c}} for the class name")
    val = subset(val, n_val, seed=seed, name=name, part="val")
    test = subset(test, n_test, seed=seed, name=name, part="test")
    return VisionTask(
        name=name,
        labels=labels,
        label_texts=tuple(templates[0].replace("{c}", c) for c in labels),
        templates=tuple(templates),
        source=f"{d} ({found['test'].kind}; validation: {how})",
        train=Split((), np.zeros(0, np.int32)),
        val=val,
        test=test,
        holdout=how,
    )
