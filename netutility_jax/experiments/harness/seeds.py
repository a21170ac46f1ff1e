"""What one training seed produced (:class:`SeedResult`), and seeds of an earlier run read back
from its results, to be reported with new ones.

A run's seeds are independent: each trains its own adapters and merges the same grid on the
same test texts. A researcher can therefore run seed 0 on one machine and seeds 1 and 2 on
another (or in another week, after the first machine's job cache is gone) and report all three
together. :func:`load` reads the seeds a rendered run wrote (``results.json`` and
``predictions.npz``, what ``netutility demo --out DIR`` writes) back into
:class:`SeedResult` objects; ``runner.run_experiment(..., seeds_from=[...])`` checks
that they belong to the same experiment (:meth:`SavedSeeds.check`: suite, preset, grid,
training settings, tasks, the scoring geometry, each test text's task and label, the validation
and test sizes, the evaluation settings and, where both runs recorded them, hashes of the
validation and test sets' token ids) before it trains anything, runs only its own seeds, and reports all of
them; the report names where each read seed came from (``results["seeds_from"]``).

What a rendered run does not keep is its seeds' adapters, scores and masks: the figures drawn
from one seed's masks (kept per task, retention by rank, the utility distribution) are drawn
from the first seed computed in this run, and not drawn when every seed is read back (each
source's own directory has them).
``results.json`` keeps every seed's kept directions per module and retention by rank from this
version on; a directory written before that is read only when it holds one seed, whose means
are its own values.

Part of the harness: imports no model and no suite.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shlex
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...errors import InputError

__all__ = ["SavedSeeds", "SeedResult", "alpha_arg", "check_distinct", "load"]

_FILES = ("results.json", "predictions.npz")


@dataclasses.dataclass
class SeedResult:
    """Everything one training seed produced (``runner.run_experiment``; :func:`load` reads one
    back from a rendered run, without its adapters, scores and masks)."""

    seed: int
    training: dict[str, dict[str, Any]]
    single_val: dict[str, float]
    single_test: dict[str, float]
    zero_shot_val: dict[str, float]
    zero_shot_test: dict[str, float]
    single_correct: np.ndarray
    zero_shot_correct: np.ndarray
    records: dict[str, dict[str, Any]]
    correct: dict[str, np.ndarray]
    scoring: dict[str, Any]
    kept_per_module: dict[str, int]
    retention: list[float]
    masks: Any
    scores: Any
    seconds: dict[str, float]
    adapters: list[Any] | None = None  # the seed's task adapters (data-free indices of a study)


@dataclasses.dataclass(frozen=True)
class SavedSeeds:
    """The seeds of one rendered run (:func:`load`).

    Attributes:
      directory: where they were read from.
      results: its ``results.json``.
      seeds: one :class:`SeedResult` per seed, without adapters, scores or masks.
      task: ``(N,)`` task index of each test text, from ``predictions.npz``.
      labels: ``(N,)`` label of each test text.
      task_names: the tasks' names in index order.
      label: how error messages name where the seeds come from (``"seeds from"``; the command
        line's ``"--seeds-from"``).
    """

    directory: pathlib.Path
    results: Mapping[str, Any]
    seeds: tuple[Any, ...]
    task: np.ndarray
    labels: np.ndarray
    task_names: tuple[str, ...]
    label: str = "seeds from"

    @property
    def seed_ids(self) -> list[int]:
        return [s.seed for s in self.seeds]

    def provenance(self) -> dict[str, Any]:
        """Where these seeds came from, for ``results["seeds_from"]``."""
        r = self.results
        return {
            "directory": str(self.directory),
            "seeds": self.seed_ids,
            "command": r.get("command"),
            "commit": r.get("commit"),
            "versions": r.get("versions"),
        }

    def check(self, expected: Mapping[str, Any], test: Any, val_texts: int) -> None:
        """Refuse these seeds unless they come from the same experiment.

        Args:
          expected: what the run about to start will record, with the keys ``suite``,
            ``preset``, ``grid``, ``train_config``, ``tasks``, ``alpha_arg``, ``evaluation``
            ``texts``, ``eval_key`` and ``train_data`` (``results.json``'s fields of the same
            names; the last three are hashes, compared when both runs recorded them) and
            ``jobs`` (the grid's job keys).
          test: the run's test set (its ``task``, ``labels`` and ``task_names``).
          val_texts: the number of validation texts.

        Raises:
          InputError: naming the directory and the first field that differs.
        """
        r, where = self.results, f"{self.label} {self.directory}"
        for key in ("suite", "preset", "grid", "train_config", "tasks"):
            if _plain(r.get(key)) != _plain(expected[key]):
                raise InputError(
                    f"{where}: its {key} differs from this run's "
                    f"({_differs(r.get(key), expected[key])}); seeds are reported together only "
                    "when they come from the same experiment"
                )
        theirs = alpha_arg(r, where)
        if theirs != _alpha(expected["alpha_arg"]):
            raise InputError(
                f"{where}: they were scored with alpha {theirs!r}, this run with "
                f"{_alpha(expected['alpha_arg'])!r} (--alpha)"
            )
        if tuple(self.task_names) != tuple(test.task_names) or not (
            np.array_equal(self.task, np.asarray(test.task))
            and np.array_equal(self.labels, np.asarray(test.labels))
        ):
            raise InputError(
                f"{where}: their test texts are not this run's ({len(self.task)} "
                f"there, {len(test.task)} here, or the same number in another order or with "
                "other labels)"
            )
        theirs_texts, ours_texts = r.get("texts"), expected.get("texts")
        if theirs_texts is not None and ours_texts is not None:
            for part in ("test", "val"):
                if theirs_texts.get(part) != ours_texts.get(part):
                    raise InputError(
                        f"{where}: their {'validation' if part == 'val' else part} texts are "
                        "not this run's (the hashes of their token ids, tasks and labels differ)"
                    )
        for key, what in _HASHED.items():
            theirs_h, ours_h = r.get(key), expected.get(key)
            if theirs_h is not None and ours_h is not None and theirs_h != ours_h:
                raise InputError(f"{where}: {what} differs from this run's (its hash)")
        ev = r.get("evaluation", {})
        if ev.get("val_texts") != val_texts:
            raise InputError(
                f"{where}: {ev.get('val_texts')} validation texts there, {val_texts} here"
            )
        theirs_ev = {k: v for k, v in ev.items() if k not in _PER_RUN_EVAL}
        ours_ev = {k: v for k, v in expected["evaluation"].items() if k not in _PER_RUN_EVAL}
        if _plain(theirs_ev) != _plain(ours_ev):
            raise InputError(
                f"{where}: their evaluation settings differ from this run's "
                f"({_differs(theirs_ev, ours_ev)})"
            )
        for s in self.seeds:
            missing = [k for k in expected["jobs"] if k not in s.correct]
            if missing:
                raise InputError(
                    f"{where}: seed {s.seed} has no result for {len(missing)} of this "
                    f"grid's {len(expected['jobs'])} merges (first: {missing[0]!r})"
                )


#: Hashes compared when both runs recorded them (runs before these fields have none).
_HASHED = {
    "eval_key": "their evaluation key (model weights, code versions, evaluation settings; the "
    "vision suite's also has its model files' sizes and modification times)",
    "train_data": "their training data (every task's training texts and labels)",
}

#: ``results["evaluation"]`` entries that are not settings (none so far; the sizes are checked
#: on their own).
_PER_RUN_EVAL: frozenset[str] = frozenset()


def load(directory: str | os.PathLike, *, label: str = "seeds from") -> SavedSeeds:
    """Read the seeds of the run rendered in ``directory`` (``results.json`` and
    ``predictions.npz``, as ``netutility demo --out`` writes them; nothing is unpickled).
    ``label`` starts every error message (the command line passes ``"--seeds-from"``).

    Raises:
      InputError: a file is missing or unreadable, or lacks what a seed needs (named).
    """
    d = pathlib.Path(directory)
    where = f"{label} {d}"
    for name in _FILES:
        if not (d / name).is_file():
            raise InputError(
                f"{where}: no {name} there (a directory written by `netutility demo --out`)"
            )
    try:
        results = json.loads((d / "results.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # (nested too deep)
        raise InputError(f"{where}: results.json is not readable JSON ({e})") from None
    try:
        # (opened here, so a file numpy refuses is closed too)
        with open(d / "predictions.npz", "rb") as f:
            z = np.load(f, allow_pickle=False)
            if not isinstance(z, np.lib.npyio.NpzFile):  # one .npy array, not an archive
                raise ValueError("one array, not an .npz archive of arrays")
            with z:
                pred = {k: np.asarray(z[k]) for k in z.files}
    # (an empty or cut file: EOFError, a damaged zip: BadZipFile, a damaged member: zlib.error)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise InputError(f"{where}: predictions.npz is not readable ({e})") from None
    try:
        return _build(d, results, pred, where, label)
    except InputError:
        raise
    except (KeyError, TypeError, IndexError, ValueError, AttributeError, OverflowError) as e:
        raise InputError(
            f"{where}: results.json or predictions.npz lacks what a seed needs "
            f"({type(e).__name__}: {e})"
        ) from None


def alpha_arg(results: Mapping[str, Any], where: str = "seeds from") -> str | float:
    """The scoring geometry a rendered run was asked for (``--alpha``): its ``alpha_arg``, or,
    in results written before that field, read off its ``netutility demo`` command (default
    ``"auto"``).

    Raises:
      InputError: neither is there.
    """
    if "alpha_arg" in results:
        return _alpha(results["alpha_arg"])
    command = results.get("command")
    if not command:
        raise InputError(
            f"{where}: no scoring geometry recorded (no alpha_arg and no command in its "
            "results.json)"
        )
    words = shlex.split(command)
    for i, w in enumerate(words):
        if w == "--alpha" and i + 1 < len(words):
            return _alpha_word(words[i + 1], where)
        if w.startswith("--alpha="):
            return _alpha_word(w.split("=", 1)[1], where)
    return "auto"


def _alpha_word(word: str, where: str) -> str | float:
    if word == "auto":
        return word
    try:
        return float(word)
    except ValueError:
        raise InputError(f"{where}: its command gives --alpha {word!r}") from None


def _alpha(x: Any) -> str | float:
    if (isinstance(x, str) and x != "auto") or isinstance(x, bool):
        raise ValueError(f"alpha_arg {x!r} is neither 'auto' nor a number")
    return x if isinstance(x, str) else float(x)


#: results.json's fields that :meth:`SavedSeeds.check` reads, their types, and their wording.
_FIELD_TYPES = (
    ("evaluation", (dict,), "an object"),
    ("texts", (dict, type(None)), "an object"),
    ("eval_key", (str, type(None)), "a hash (text)"),
    ("train_data", (str, type(None)), "a hash (text)"),
)


def _build(
    d: pathlib.Path,
    results: Mapping[str, Any],
    pred: Mapping[str, np.ndarray],
    where: str,
    label: str,
) -> SavedSeeds:
    for key, types, what in _FIELD_TYPES:  # what check() compares, of the type it compares
        if not isinstance(results.get(key, types[-1]()), types):
            raise InputError(
                f"{where}: results.json's {key!r} is of type {type(results[key]).__name__}, not {what}"
            )
    alpha_arg(results, where)  # (readable: a number, "auto", or the command's --alpha)
    seeds = [int(s) for s in results["seeds"]]
    names = [t["name"] for t in results["tasks"]]
    task = pred["task"].astype(np.int64)
    kept = results["analyses"]["kept_per_module"]
    retention = results["analyses"]["retention_by_rank"]
    single = results["single"]
    old = "per_seed" not in kept or "per_seed" not in retention
    if old and len(seeds) != 1:
        raise InputError(
            f"{where}: it holds {len(seeds)} seeds but not each seed's kept directions "
            "(written by an older version, which kept only their means); read directories of "
            "one seed each"
        )
    out = [
        _seed_result(
            i, seed, results, pred, where, names=names, single=single, kept=kept,
            retention=retention, old=old, n_seeds=len(seeds),
        )
        for i, seed in enumerate(seeds)
    ]  # fmt: skip
    _check_shapes(out, len(task), where)
    return SavedSeeds(
        directory=d,
        results=results,
        seeds=tuple(out),
        task=task,
        labels=np.asarray(pred["label"]),
        task_names=tuple(str(x) for x in pred["task_names"]),
        label=label,
    )


def _seed_result(
    i: int,
    seed: int,
    results: Mapping[str, Any],
    pred: Mapping[str, np.ndarray],
    where: str,
    *,
    names: Sequence[str],
    single: Mapping[str, Any],
    kept: Mapping[str, Any],
    retention: Mapping[str, Any],
    old: bool,
    n_seeds: int,
) -> SeedResult:
    """The ``i``-th of the ``n_seeds`` seeds of a rendered run, without its adapters, scores
    and masks: ``names`` its tasks, ``single`` its single-LoRA and zero-shot accuracies,
    ``kept`` and ``retention`` its analyses' kept directions and retention by rank (``old``:
    written before each seed's were kept, a run of one seed).

    Raises:
      InputError: a merge with a record and no test correctness or the reverse, or no per-seed
        zero-shot accuracies in a run of several seeds.
    """
    k = f"s{seed}/"
    correct = {key[len(k) :]: pred[key].astype(bool) for key in pred if key.startswith(k)}
    single_correct = correct.pop("single")
    zero_shot_correct = correct.pop("zero_shot")
    records = results["merges"][str(seed)]
    missing = [key for key in records if key not in correct]
    if missing:
        raise InputError(
            f"{where}: predictions.npz has no test correctness for seed {seed}'s {missing[0]!r}"
        )
    unrecorded = [key for key in correct if key not in records]
    if unrecorded:
        raise InputError(
            f"{where}: results.json has no record of seed {seed}'s {unrecorded[0]!r} "
            "(predictions.npz has its test correctness)"
        )
    if "zero_shot_test_per_seed" in single[names[0]]:
        zs_test = {n: single[n]["zero_shot_test_per_seed"][i] for n in names}
        zs_val = {n: single[n]["zero_shot_val_per_seed"][i] for n in names}
    elif n_seeds == 1:
        zs_test = {n: single[n]["zero_shot_test"] for n in names}
        zs_val = {n: single[n]["zero_shot_val"] for n in names}
    else:  # written before the per-seed zero-shot fields: the first seed's only
        raise InputError(f"{where}: no per-seed zero-shot accuracies for seed {seed}")
    return SeedResult(
        seed=seed,
        training=results["training"][str(seed)],
        single_val={n: single[n]["individual_val_per_seed"][i] for n in names},
        single_test={n: single[n]["individual_test_per_seed"][i] for n in names},
        zero_shot_val=zs_val,
        zero_shot_test=zs_test,
        single_correct=single_correct,
        zero_shot_correct=zero_shot_correct,
        records={key: dict(v) for key, v in records.items()},
        correct=correct,
        scoring=results["scoring"][str(seed)],
        kept_per_module=(kept["mean_over_seeds"] if old else kept["per_seed"][str(seed)]),
        retention=[  # (a rank slot with no candidate: NaN, written as null)
            np.nan if v is None else float(v)
            for v in (retention["mean_over_seeds"] if old else retention["per_seed"][str(seed)])
        ],
        masks=None,
        scores=None,
        seconds=results["timings"]["per_seed"][str(seed)],
    )


def _check_shapes(out: Sequence[SeedResult], n: int, where: str) -> None:
    """Every seed's test correctness has one entry per test text (``n``).

    Raises:
      InputError: naming the seed, the entry of predictions.npz and its shape.
    """
    for s in out:
        for key, c in [
            ("single", s.single_correct),
            ("zero_shot", s.zero_shot_correct),
            *s.correct.items(),
        ]:
            if c.shape != (n,):
                raise InputError(
                    f"{where}: s{s.seed}/{key} in predictions.npz has shape {c.shape}, "
                    f"expected ({n},) (one entry per test text)"
                )


def check_distinct(
    own: Sequence[int], saved: Sequence[SavedSeeds], *, own_label: str = "this run's seeds"
) -> None:
    """Refuse a seed given twice: run here and read, or read from two directories.
    ``own_label`` names the seeds run here in the message (the command line: ``--seeds``).

    Raises:
      InputError: naming the seed and where it is given.
    """
    where: dict[int, str] = {s: own_label for s in own}
    for sv in saved:
        for s in sv.seed_ids:
            if s in where:
                raise InputError(
                    f"seed {s} is both in {where[s]} and in {sv.directory} ({sv.label}); give "
                    "each seed once"
                )
            where[s] = str(sv.directory)


def _plain(x: Any) -> Any:
    """``x`` as JSON would give it back (tuples as lists, keys as strings)."""
    from . import records

    return json.loads(json.dumps(records.to_jsonable(x), sort_keys=True))


def _differs(a: Any, b: Any, path: str = "") -> str:
    """Where two JSON-like values first differ, as ``path: theirs vs ours``."""
    a, b = _plain(a), _plain(b)
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _differs(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return _differs(x, y, f"{path}[{i}]")
    text = f"{json.dumps(a)[:80]} there, {json.dumps(b)[:80]} here"
    return f"{path}: {text}" if path else text
