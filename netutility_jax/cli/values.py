"""The ``netutility`` command's argument types: each flag's value parsed, or refused with a
message naming the range and the value given (argparse prints it on one line), and
:func:`join_negative_values`, which lets a flag take a value that starts with ``-``."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from .common import shown

__all__ = [
    "ALPHA_MAX",
    "LAM_MAX",
    "MAX_BUDGET",
    "SEED_BOUND",
    "WEIGHT_BOUND",
    "WEIGHT_RANGE",
    "auto_or",
    "bounded_float",
    "coef",
    "count",
    "devices",
    "float_or_auto",
    "index",
    "int_in",
    "join_negative_values",
    "number",
    "positive_int",
    "rank",
    "seed",
    "serving_ranks",
    "weight_ok",
    "weights",
]

MAX_BUDGET = 2**31 - 1
"""Largest ``--budget`` (and ``--rank``): a budget at or above the number of candidate
directions keeps them all, so a larger one would change nothing."""
SEED_BOUND = 2**32
"""``--seed`` is in ``[0, SEED_BOUND)``: ``jax.random.key`` keeps 32 bits of the seed (without
x64), so larger seeds would repeat smaller ones."""


def number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def float_or_auto(text: str) -> float | str:
    """argparse type: ``'auto'`` or a finite number >= 0."""
    if text == "auto":
        return text
    v = number(text)
    if v is None:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {shown(text)}")
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(
            f"expected a finite number >= 0 or 'auto', got {shown(text)}"
        )
    return v


def bounded_float(low: float, high: float, *, low_open: bool, high_open: bool, what: str):
    """argparse type: a finite number in the interval ``low``..``high`` (open where asked)."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def parse(text: str) -> float:
        v = number(text)
        if (
            v is None
            or not math.isfinite(v)
            or v < low
            or v > high
            or (low_open and v == low)
            or (high_open and v == high)
        ):
            raise argparse.ArgumentTypeError(
                f"expected a finite number in {interval} ({what}), got {shown(text)}"
            )
        return v

    parse.__name__ = f"number in {interval}"
    return parse


def serving_ranks(text: str) -> str | tuple[int, ...]:
    """argparse type of ``--serving-ranks``: ``vllm`` or a comma list of positive ranks."""
    if text == "vllm":
        return text
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isdigit() and 0 < int(p) <= MAX_BUDGET for p in parts):
        raise argparse.ArgumentTypeError(
            f"expected 'vllm' or a comma list of positive ranks (e.g. 8,16,32,64), got "
            f"{shown(text)}"
        )
    return tuple(int(p) for p in parts)


WEIGHT_BOUND = 1e30
"""A task's weight is at most this large and at least its inverse in size: the weighted
update (a LoRA scale times the weight) must stay in float32's range, 1.2e-38 to 3.4e38."""
WEIGHT_RANGE = f"a nonzero number between {1 / WEIGHT_BOUND:g} and {WEIGHT_BOUND:g} in size"
"""How messages state :data:`WEIGHT_BOUND`."""


def weight_ok(w: float) -> bool:
    """Whether ``w`` is a usable task weight: finite, nonzero, within :data:`WEIGHT_BOUND`."""
    return math.isfinite(w) and 1 / WEIGHT_BOUND <= abs(w) <= WEIGHT_BOUND


def coef(text: str) -> float:
    """argparse type of ``--coef``: a finite nonzero number. Unlike a weight it has no bound
    here: the merge runs a coefficient outside float32's normal range exactly (its power of
    two applied apart) and refuses, naming ``coef=``, one whose merged update would leave the
    dtype's range."""
    v = number(text)
    if v is None or not math.isfinite(v) or v == 0:
        raise argparse.ArgumentTypeError(
            "expected a finite nonzero number (the merged update is multiplied by it; a negative "
            f"one subtracts it), got {shown(text)}"
        )
    return v


def int_in(text: str, low: int, high: int, expected: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = None
    if v is None or not low <= v <= high:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {shown(text)}")
    return v


def positive_int(text: str) -> int:
    """argparse type of ``--budget`` and ``--rank``: an integer in ``[1, MAX_BUDGET]``."""
    return int_in(
        text,
        1,
        MAX_BUDGET,
        f"a positive integer up to {MAX_BUDGET} (2**31 - 1; a budget at or above the number "
        "of candidate directions keeps them all)",
    )


def rank(text: str) -> int:
    """argparse type of ``--rank``: an integer in ``[1, MAX_BUDGET]``."""
    return int_in(
        text,
        1,
        MAX_BUDGET,
        f"a positive integer up to {MAX_BUDGET} (2**31 - 1; the rank dense results are "
        "truncated to, capped at each module's min(d_in, d_out))",
    )


def count(text: str) -> int:
    """argparse type of ``--num-processes``: an integer in ``[1, 2**31 - 1]``."""
    return int_in(text, 1, MAX_BUDGET, "a positive integer (the number of processes)")


def index(text: str) -> int:
    """argparse type of ``--process-id``: an integer in ``[0, 2**31 - 2]``."""
    return int_in(text, 0, MAX_BUDGET - 1, "an integer >= 0 (this process's index)")


def seed(text: str) -> int:
    """argparse type of ``--seed``: an integer in ``[0, SEED_BOUND)``."""
    return int_in(
        text,
        0,
        SEED_BOUND - 1,
        f"an integer in [0, 2**32) = [0, {SEED_BOUND - 1}] (jax.random.key keeps 32 bits)",
    )


def weights(text: str) -> tuple[float, ...]:
    """argparse type of ``--weights``: a comma list of numbers, each :func:`weight_ok`."""
    parts = [p.strip() for p in text.split(",")]
    values = [number(p) for p in parts]
    if not parts or any(v is None or not weight_ok(v) for v in values):
        bad = next(p for p, v in zip(parts, values, strict=True) if v is None or not weight_ok(v))
        raise argparse.ArgumentTypeError(
            f"expected a comma list of weights, one per adapter, each {WEIGHT_RANGE} (e.g. "
            f"1,0.5,2 or -1,0.5,2; drop an adapter instead of weighting it 0), got {shown(text)} "
            f"({shown(bad)} is not)"
        )
    return tuple(float(v) for v in values)  # type: ignore[arg-type]


ALPHA_MAX = 16.0
"""Largest ``--alpha``: the geometry exponent raises each task's normalised singular values
to it; the paper uses 0 and 1, and far larger exponents send every direction's interference
but the largest below float32's range (the automatic lambda is then 0)."""
LAM_MAX = 1e30
"""Largest ``--lam``: lambda times an interference must stay in float32's range."""


def auto_or(low: float, high: float, what: str):
    """argparse type: ``'auto'`` or a finite number in ``[low, high]``."""

    def parse(text: str) -> float | str:
        if text == "auto":
            return text
        v = number(text)
        if v is None or not math.isfinite(v) or not low <= v <= high:
            raise argparse.ArgumentTypeError(
                f"expected 'auto' or a number in [{low:g}, {high:g}] ({what}), got {shown(text)}"
            )
        return v

    parse.__name__ = f"'auto' or a number in [{low:g}, {high:g}]"
    return parse


def join_negative_values(actions: Sequence[argparse.Action], argv: Sequence[str]) -> list[str]:
    """``argv`` with each value that starts with ``-`` but reads as numbers (``--weights
    -1,0.5,2``, ``--coef -1e-3``) joined to its flag (``--weights=-1,0.5,2``), which argparse
    would otherwise read as a flag of its own. Only flags that take one typed value (among
    ``actions``) are joined; anything after ``--`` is left alone."""
    takes = {
        o
        for a in actions
        if a.option_strings and a.nargs is None and a.type is not None
        for o in a.option_strings
    }
    out: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            out.extend(argv[i:])
            break
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if (
            tok in takes
            and nxt is not None
            and nxt.startswith("-")
            and all(number(p) is not None for p in nxt.split(","))
        ):
            out.append(f"{tok}={nxt}")
            i += 2
            continue
        out.append(tok)
        i += 1
    return out


def devices(text: str) -> str | int:
    """argparse type of ``--devices``: ``all`` or a positive count."""
    if text.strip().lower() == "all":
        return "all"
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not 'all' or a positive number of devices"
        ) from None
