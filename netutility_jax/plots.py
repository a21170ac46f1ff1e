"""Figures of a selection: where the budget went, prefix retention, kept per task, utilities.

Every function returns a ``matplotlib.figure.Figure`` built without ``pyplot`` (no global state,
no GUI backend: the figure carries its own Agg canvas), and with ``path=`` also writes it as a
PNG: rendered to a temporary file in the same directory, then moved into place with
``os.replace``, so a reader never sees a half-written file. An existing ``path`` is never
overwritten.

matplotlib is an optional dependency (``pip install netutility-jax[plots]``), imported when a
function is first called.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._core.io import atomic_file
from .allocation.analysis import non_prefix_fraction, retention_by_rank
from .errors import InputError, InputTypeError
from .pipeline.merging import Report
from .scoring.utility import Scores

__all__ = [
    "budget_heatmap",
    "kept_per_task",
    "parse_module_name",
    "prefix_retention",
    "utility_distribution",
]

_INSTALL = "pip install netutility-jax[plots]"


def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            f"netutility_jax.plots needs matplotlib, an optional dependency: {_INSTALL}"
        ) from e
    return Figure, FigureCanvasAgg


def _figure(fn: str, path: Any, figsize: tuple[float, float]) -> Any:
    if path is not None:
        _check_free(fn, path)
    Figure, FigureCanvasAgg = _matplotlib()
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _check_free(fn: str, path: Any) -> None:
    path = os.fspath(path)
    if os.path.lexists(path):
        raise FileExistsError(
            f"{fn}: {path!r} already exists; figures are never overwritten. Pick a new path or "
            "delete the old file first."
        )


def _finish(fn: str, fig: Any, path: Any) -> Any:
    if path is None:
        return fig
    _check_free(fn, path)
    with atomic_file(os.fspath(path), "wb") as f:
        fig.savefig(f, format="png", dpi=150)
    return fig


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def _kept_counts(fn: str, masks: Any) -> dict[str, np.ndarray]:
    """``{name: (M,) int}`` directions kept per module and task, from masks or a Report."""
    if isinstance(masks, Report):
        return {k: np.asarray(v, np.int64) for k, v in masks.kept.items()}
    return {k: v.sum(1).astype(np.int64) for k, v in _masks(fn, masks).items()}


def _masks(fn: str, masks: Any) -> dict[str, np.ndarray]:
    if not isinstance(masks, Mapping) or not masks:
        raise InputTypeError(
            f"{fn}: expected the {{name: bool (M, r_max)}} masks returned by nu.allocate, got "
            f"{type(masks).__name__}{' (empty)' if isinstance(masks, Mapping) else ''}."
        )
    out = {}
    for k, v in masks.items():
        v = np.asarray(v)
        if v.ndim != 2:
            raise InputError(
                f"{fn}: mask of module {k!r} has shape {v.shape}; expected (M, r_max) as returned "
                "by nu.allocate."
            )
        out[k] = v.astype(bool)
    m = {v.shape[0] for v in out.values()}
    if len(m) > 1:
        raise InputError(f"{fn}: masks disagree on the number of tasks M: {sorted(m)}.")
    return out


def _task_labels(fn: str, task_names: Sequence[str] | None, m_tasks: int) -> list[str]:
    if task_names is None:
        return [f"task {i}" for i in range(m_tasks)]
    names = [str(t) for t in task_names]
    if len(names) != m_tasks:
        raise InputError(
            f"{fn}: {len(names)} task_names for M = {m_tasks} tasks; pass one name per task."
        )
    return names


def _check_scores(fn: str, scores: Any, masks: Mapping[str, np.ndarray] | None = None) -> None:
    """``scores`` is a :class:`nu.Scores`; with ``masks``, of the same modules and shapes."""
    if not isinstance(scores, Scores):
        raise InputTypeError(
            f"{fn}: expected the nu.Scores returned by nu.score, got {type(scores)}."
        )
    if masks is None:
        return
    if set(masks) != set(scores.modules):
        diff = sorted(set(masks) ^ set(scores.modules))
        raise InputError(
            f"{fn}: masks and scores name different modules (e.g. {diff[:3]}); pass the masks "
            "nu.allocate returned for these scores."
        )
    for name, v in masks.items():
        shape = tuple(np.shape(scores.modules[name].utility))
        if v.shape != shape:
            raise InputError(
                f"{fn}: mask of module {name!r} has shape {v.shape} but its scores {shape}; pass "
                "the masks nu.allocate returned for these scores."
            )


# ---------------------------------------------------------------------------------------------
# Module names
# ---------------------------------------------------------------------------------------------


def parse_module_name(name: str) -> tuple[int | None, str]:
    """Layer index and module type of a module name.

    The name is split on "." and "/"; the layer index is its first all-digit part, the module type
    the last non-digit part after it (or the part before it if none follows). A name without a
    digit part has no layer index; its type is its last part.

    Args:
      name: a PEFT-style (``"model.layers.3.self_attn.q_proj"``) or "/"-joined
        (``"layers/3/attention/query"``) module name.

    Returns:
      ``(layer, module_type)``; ``layer`` is None if the name has no layer index.

    Example:
      >>> from netutility_jax.plots import parse_module_name
      >>> parse_module_name("model.layers.3.self_attn.q_proj")
      (3, 'q_proj')
      >>> parse_module_name("layers/12/attention/query"), parse_module_name("head")
      ((12, 'query'), (None, 'head'))
    """
    parts = [p for p in re.split(r"[./]", name) if p]
    for i, p in enumerate(parts):
        if p.isdigit():
            after = [q for q in parts[i + 1 :] if not q.isdigit()]
            before = [q for q in parts[:i] if not q.isdigit()]
            kind = after[-1] if after else (before[-1] if before else name)
            return int(p), kind
    return None, parts[-1] if parts else name


def _grid(names: Sequence[str]) -> tuple[list[str], list[str], dict[str, tuple[int, int]]]:
    """Rows, columns and each module's cell of the budget heatmap."""
    parsed = {n: parse_module_name(n) for n in names}
    if all(layer is not None for layer, _ in parsed.values()):
        for kind_of in (
            lambda n: parsed[n][1],
            # two modules of one layer share a type ("attn.q" and "cross_attn.q"): use the full
            # path after the layer index
            lambda n: ".".join(re.split(r"[./]", n)[_layer_pos(n) + 1 :]) or n,
        ):
            cells = {n: (parsed[n][0], kind_of(n)) for n in names}
            if len(set(cells.values())) == len(cells):
                layers = sorted({c[0] for c in cells.values()})
                kinds = list(dict.fromkeys(c[1] for c in cells.values()))
                pos = {n: (layers.index(c[0]), kinds.index(c[1])) for n, c in cells.items()}
                return [str(x) for x in layers], kinds, pos
    return list(names), ["kept"], {n: (i, 0) for i, n in enumerate(names)}


def _layer_pos(name: str) -> int:
    parts = re.split(r"[./]", name)
    return next(i for i, p in enumerate(parts) if p.isdigit())


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------


def budget_heatmap(
    masks: Mapping[str, Any] | Report,
    *,
    task: int | None = None,
    annotate: bool | None = None,
    cmap: str = "viridis",
    title: str | None = None,
    path: str | os.PathLike | None = None,
) -> Any:
    """Directions kept per layer and module type (the paper's budget heatmap).

    Module names are parsed by :func:`parse_module_name` (``"model.layers.3.self_attn.q_proj"``
    -> layer 3, ``q_proj``). Rows are layers, columns module types in first-appearance order;
    a layer without some module type leaves that cell blank. If some name has no layer index, or
    two modules would share a cell, there is one row per module instead (a single column).

    Args:
      masks: ``{name: bool (M, r_max)}`` from :func:`nu.allocate`, or a :class:`nu.Report`
        (its ``kept`` counts).
      task: count only this task's directions; None sums over tasks.
      annotate: write the count in each cell; default when there are at most 400 cells.
      cmap: matplotlib colormap name.
      title: axes title; default says what is counted.
      path: also save the figure there as PNG (must not exist).

    Returns:
      ``matplotlib.figure.Figure`` with the heatmap axes and its colorbar; the image data
      (``fig.axes[0].images[0].get_array()``) is the ``(rows, columns)`` masked count array.

    Raises:
      TypeError / ValueError: masks not as returned by :func:`nu.allocate`, task out of range.
      FileExistsError: ``path`` exists.
      ImportError: matplotlib is not installed.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> masks = {f"model.layers.{l}.self_attn.{m}": np.ones((2, 4), bool)
      ...          for l in range(3) for m in ("q_proj", "v_proj")}
      >>> fig = nu.plots.budget_heatmap(masks)
      >>> fig.axes[0].images[0].get_array().shape
      (3, 2)
    """
    fn = "nu.plots.budget_heatmap"
    kept = _kept_counts(fn, masks)
    m_tasks = len(next(iter(kept.values())))
    if task is not None and not (isinstance(task, int) and 0 <= task < m_tasks):
        raise InputError(f"{fn}: task={task!r}; expected None or an int in [0, {m_tasks}).")
    rows, cols, pos = _grid(list(kept))
    data = np.full((len(rows), len(cols)), np.nan)
    for name, counts in kept.items():
        data[pos[name]] = counts.sum() if task is None else counts[task]
    fig = _figure(fn, path, (min(3.0 + 0.7 * len(cols), 16.0), min(1.6 + 0.3 * len(rows), 24.0)))
    ax = fig.add_subplot()
    shown = np.ma.masked_invalid(data)
    im = ax.imshow(shown, aspect="auto", cmap=cmap, interpolation="nearest")
    fig.colorbar(im, ax=ax, label="directions kept")
    ax.set_xticks(range(len(cols)), cols, rotation=45 if len(cols) > 3 else 0, ha="right")
    ax.set_yticks(range(len(rows)), rows)
    by_layer = cols != ["kept"]
    ax.set_xlabel("module type" if by_layer else "")
    ax.set_ylabel("layer" if by_layer else "module")
    what = "all tasks" if task is None else f"task {task}"
    ax.set_title(title if title is not None else f"Directions kept per module ({what})")
    if annotate or (annotate is None and data.size <= 400):
        finite = data[np.isfinite(data)]
        mid = (finite.min() + finite.max()) / 2 if finite.size else 0
        for (i, j), v in np.ndenumerate(data):
            if np.isfinite(v):
                ax.text(
                    j,
                    i,
                    f"{int(v)}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="black" if v > mid else "white",
                )
    return _finish(fn, fig, path)


def _prefix_masks(masks: Mapping[str, np.ndarray], scores: Scores) -> dict[str, np.ndarray]:
    """Each task keeps as many directions as in ``masks``, but its leading candidates."""
    out = {}
    for name, v in masks.items():
        cand = np.isfinite(np.asarray(scores.modules[name].utility))
        n = (v & cand).sum(1, keepdims=True)
        out[name] = (np.arange(v.shape[1]) < n) & cand
    return out


def prefix_retention(
    masks: Mapping[str, Any],
    scores: Scores,
    *,
    title: str | None = None,
    path: str | os.PathLike | None = None,
) -> Any:
    """Fraction of kept sets that retain their k-th singular direction, vs. rank k.

    The solid line is :func:`nu.retention_by_rank` of the selection: over the (module, task) sets
    whose k-th slot is a candidate, the fraction that keep it. The dashed line is what a prefix
    rule keeping the same number of directions per set would give (each set keeps its leading
    components): a step towards 0. Where the solid line is above the dashed one at large k, the
    selection keeps tail directions a prefix rule drops (paper, "The optimal set need not be a
    prefix"); the legend gives :func:`nu.non_prefix_fraction`.

    Args:
      masks: ``{name: bool (M, r_max)}`` from :func:`nu.allocate`.
      scores: the :class:`nu.Scores` the masks were allocated from.
      title: axes title.
      path: also save the figure there as PNG (must not exist).

    Returns:
      ``matplotlib.figure.Figure`` with one axes and two lines (selection, prefix rule), x = rank
      ``k = 1..r_max``.

    Raises:
      TypeError / ValueError: masks or scores not as returned by nu.allocate / nu.score, or naming
        different modules.
      FileExistsError: ``path`` exists.
      ImportError: matplotlib is not installed.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> rng = np.random.default_rng(0)
      >>> ads = [{"q": {"lora_a": rng.normal(size=(16, 4)), "lora_b": rng.normal(size=(4, 8))}}
      ...        for _ in range(3)]
      >>> sc = nu.score(ads)
      >>> fig = nu.plots.prefix_retention(nu.allocate(sc, 4), sc)
      >>> len(fig.axes[0].lines)
      2
    """
    fn = "nu.plots.prefix_retention"
    m = _masks(fn, masks)
    _check_scores(fn, scores, m)
    observed = np.asarray(retention_by_rank(m, scores))
    rule = np.asarray(retention_by_rank(_prefix_masks(m, scores), scores))
    k = np.arange(1, observed.shape[0] + 1)
    fig = _figure(fn, path, (5.0, 3.4))
    ax = fig.add_subplot()
    frac = non_prefix_fraction(m)
    ax.plot(k, observed, marker="o", label=f"selection ({frac:.0%} of kept sets non-prefix)")
    ax.plot(k, rule, linestyle="--", drawstyle="steps-mid", label="prefix rule, same counts")
    ax.set_xlabel("singular direction rank k")
    ax.set_ylabel("fraction of sets keeping it")
    ax.set_ylim(-0.03, 1.03)
    ax.set_xticks(k if k.size <= 20 else np.linspace(1, k[-1], 9).round().astype(int))
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(title if title is not None else "Retention by rank")
    return _finish(fn, fig, path)


def kept_per_task(
    masks: Mapping[str, Any] | Report,
    task_names: Sequence[str] | None = None,
    *,
    title: str | None = None,
    path: str | os.PathLike | None = None,
) -> Any:
    """Bar chart of the directions kept per task over all modules (:func:`nu.kept_per_task`).

    A dashed line marks the equal share (total kept / M) that a uniform split would give.

    Args:
      masks: ``{name: bool (M, r_max)}`` from :func:`nu.allocate`, or a :class:`nu.Report`.
      task_names: M labels; default ``"task 0"``, ``"task 1"``...
      title: axes title.
      path: also save the figure there as PNG (must not exist).

    Returns:
      ``matplotlib.figure.Figure`` with one axes holding M bars.

    Raises:
      TypeError / ValueError: masks not as returned by nu.allocate; wrong number of task names.
      FileExistsError: ``path`` exists.
      ImportError: matplotlib is not installed.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> masks = {"q": np.array([[1, 1, 0], [1, 0, 0]], bool)}
      >>> fig = nu.plots.kept_per_task(masks, ["nli", "qa"])
      >>> [int(p.get_height()) for p in fig.axes[0].patches]
      [2, 1]
    """
    fn = "nu.plots.kept_per_task"
    kept = _kept_counts(fn, masks)
    per_task = np.sum(list(kept.values()), axis=0)
    labels = _task_labels(fn, task_names, per_task.shape[0])
    fig = _figure(fn, path, (max(3.0, 1.2 + 0.55 * len(labels)), 3.2))
    ax = fig.add_subplot()
    bars = ax.bar(range(len(labels)), per_task.tolist(), color="tab:blue")
    ax.bar_label(bars, fontsize=8)
    ax.axhline(per_task.sum() / len(labels), color="gray", linestyle="--", label="equal share")
    ax.set_xticks(range(len(labels)), labels, rotation=45 if len(labels) > 6 else 0)
    ax.set_ylabel("directions kept")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title if title is not None else "Directions kept per task")
    return _finish(fn, fig, path)


def utility_distribution(
    scores: Scores,
    masks: Mapping[str, Any] | None = None,
    task_names: Sequence[str] | None = None,
    *,
    bins: int = 30,
    title: str | None = None,
    path: str | os.PathLike | None = None,
) -> Any:
    """Histograms of the candidates' net utilities, one panel per task, kept ones highlighted.

    Each panel pools the task's candidates over all modules (non-candidates, ``utility = -inf``,
    are left out), on bins shared by all panels. With ``masks``, each bar is split into the
    dropped (gray) and kept (orange) candidates. A vertical line marks utility 0, the
    ``positive_only`` cut of :func:`nu.allocate`.

    Args:
      scores: :class:`nu.Scores` from :func:`nu.score`.
      masks: optional ``{name: bool (M, r_max)}`` from :func:`nu.allocate` on these scores.
      task_names: M labels; default ``"task 0"``...
      bins: number of histogram bins.
      title: figure title.
      path: also save the figure there as PNG (must not exist).

    Returns:
      ``matplotlib.figure.Figure`` with M axes (one per task, sharing x). Each axes' bar
      containers (``ax.containers``) hold the histogram: one (all candidates) without masks; two
      (dropped, kept) with masks.

    Raises:
      TypeError / ValueError: scores or masks not as returned by nu.score / nu.allocate; wrong
        number of task names.
      FileExistsError: ``path`` exists.
      ImportError: matplotlib is not installed.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> rng = np.random.default_rng(0)
      >>> ads = [{"q": {"lora_a": rng.normal(size=(16, 4)), "lora_b": rng.normal(size=(4, 8))}}
      ...        for _ in range(3)]
      >>> sc = nu.score(ads)
      >>> fig = nu.plots.utility_distribution(sc, nu.allocate(sc, 4))
      >>> len(fig.axes), int(sum(p.get_height() for ax in fig.axes for p in ax.patches))
      (3, 12)
    """
    fn = "nu.plots.utility_distribution"
    _check_scores(fn, scores)
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise InputError(f"{fn}: bins={bins!r}; expected a positive integer.")
    utils = {k: np.asarray(v.utility, np.float64) for k, v in scores.modules.items()}
    m_tasks = next(iter(utils.values())).shape[0]
    m = None
    if masks is not None:
        m = _masks(fn, masks)
        _check_scores(fn, scores, m)
    labels = _task_labels(fn, task_names, m_tasks)
    values, kept = [], []
    for j in range(m_tasks):
        u = np.concatenate([x[j] for x in utils.values()])
        k = (
            np.concatenate([m[name][j] for name in utils])
            if m is not None
            else np.zeros(u.shape, bool)
        )
        fin = np.isfinite(u)
        values.append(u[fin])
        kept.append(k[fin])
    pooled = np.concatenate(values)
    edges = np.histogram_bin_edges(pooled if pooled.size else np.zeros(1), bins=bins)
    fig = _figure(fn, path, (5.0, min(1.2 + 1.5 * m_tasks, 30.0)))
    axes = fig.subplots(m_tasks, 1, sharex=True, squeeze=False)[:, 0]
    for j, ax in enumerate(axes):
        u, k = values[j], kept[j]
        if m is None:
            ax.hist(u, bins=edges, color="tab:blue")
        else:
            ax.hist(
                [u[~k], u[k]],
                bins=edges,
                stacked=True,
                color=["0.7", "tab:orange"],
                label=["dropped", "kept"],
            )
        ax.axvline(0.0, color="black", linewidth=0.8, linestyle=":")
        ax.set_ylabel("count")
        ax.set_title(
            f"{labels[j]}: {u.size} candidates"
            + (f", {int(k.sum())} kept" if m is not None else ""),
            fontsize=9,
        )
    if m is not None:
        axes[0].legend(loc="upper left", fontsize=8)
    axes[-1].set_xlabel("net utility (benefit - lambda * interference)")
    fig.suptitle(
        title
        if title is not None
        else f"Net utility of candidates (lambda = {float(scores.lam):.3g})"
    )
    return _finish(fn, fig, path)
