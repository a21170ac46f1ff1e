"""What a merge from folders writes, and how: the output folder assembled in a staging folder
beside ``out`` and renamed into place (:func:`assembled`), holding the PEFT adapter
(:func:`write_output`), the JSON report (:func:`report_dict`, :data:`REPORT_NAME`, with the
configuration that replays it: :func:`recorded_config`), the model card (:func:`model_card`)
and the plots (:func:`write_plots`); the progress bar's steps (:func:`step`,
:func:`chunk_steps`)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import pathlib
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .._core import io as _io
from ..errors import FileAccessError, InputError, NetUtilityError, PathExistsError
from ._config import MergeConfig, MomentsFile
from ._digests import adapter_digest

__all__ = [
    "REPORT_NAME",
    "STAGING_TAG",
    "Merged",
    "Run",
    "Terms",
    "assembled",
    "chunk_steps",
    "finish_output",
    "model_card",
    "recorded_config",
    "report_dict",
    "staging_name",
    "step",
    "uniform_rank",
    "write_error",
    "write_extras",
    "write_merge",
    "write_output",
    "write_plots",
]

REPORT_NAME = "netutility_report.json"
STAGING_TAG = "netutility-staging"


class Terms(NamedTuple):
    """How a merge's messages name the caller and its settings: ``fn`` (the function or
    command) and ``spell(field)`` (a :class:`MergeConfig` field or ``out``, as the caller gives
    it: the field's name for Python callers; ``--chunk-mb`` for the command line)."""

    fn: str = "nu.merge_folders"
    spell: Callable[[str], str] = str


@dataclasses.dataclass
class Run:
    """One merge from folders: its inputs, where it writes, and how it reports (the progress
    bar ``bar``, the notes ``say(kind, text)``, the process group ``ex``)."""

    paths: tuple[str, ...]
    names: tuple[str, ...]
    out: pathlib.Path
    out_text: str  # ``out`` as the caller gave it (messages)
    config: MergeConfig
    terms: Terms
    say: Callable[[str, str], None]
    bar: Any = None
    ex: Any = None  # the process group (pipeline._exchange); None: this process alone
    keep_shards: bool = False
    digests: Sequence[str | None] | None = None  # each folder's digest before the merge read it
    moments: list[MomentsFile | None] | None = None  # the moments files as read (their digests)

    def t(self, field: str) -> str:
        return self.terms.spell(field)

    @property
    def processes(self) -> int:
        return 1 if self.ex is None else self.ex.count


class Merged(NamedTuple):
    """What the loading and merging steps made, for the writing step."""

    loaded: Any  # peft.load_adapters' or open_adapters' result: base config, coverage
    merged: Any  # the merged adapter
    report: Any  # its nu.Report
    key: Any  # the PRNG key of the method's random choices, or None


def step(bar, done: str, next_step: str = "") -> None:
    """Mark a step done and name the one now running."""
    if bar is not None:
        bar.update(1)
        bar.set_postfix_str(next_step or done)


def chunk_steps(bar, what: str) -> Callable[[int, int], None] | None:
    """The streamed merge's ``progress`` callback (:func:`nu.merge_adapters_streaming`) on
    ``bar``: the chunk reads it announces (``done=0``) are added to the bar's total, then the
    bar advances one step per chunk read and scored or merged; None without a bar."""
    if bar is None:
        return None
    seen = [0]

    def report(done: int, total: int) -> None:
        if done == 0:
            bar.total += total
            bar.refresh()
        elif done > seen[0]:
            bar.update(done - seen[0])
            seen[0] = done
        bar.set_postfix_str(f"{what}: chunk {done} of {total}")

    return report


def report_dict(
    report: Any,
    *,
    adapters: Sequence[str],
    options: dict[str, Any],
    coverage: Mapping[str, Sequence[int]] | None = None,
    names: Sequence[str] | None = None,
    config: Mapping[str, Any] | None = None,
) -> dict:
    """A JSON-ready dict of a :class:`nu.Report` (masks and scores left out; NaN -> null;
    ``zeroed``: the modules whose merged update is exactly zero), with the per-module task
    coverage ``{module: [tasks that have it]}`` if given (by name with ``names``, else by
    index). With ``names``: ``tasks``, per task its name, folder, weight, kept directions,
    uniform share of the budget (None with allocation all) and candidates. ``config``: the
    resolved configuration that replays the merge (``netutility merge --config``). Always:
    ``netutility_version`` and ``created_utc`` (ISO 8601, UTC)."""
    from .. import __version__
    from ..pipeline.planning import report_shares

    keep = (
        "method", "space", "allocation", "scope", "budget", "budget_spent", "lam", "alpha",
        "heterogeneity", "non_prefix_fraction", "kept_per_task", "kept", "ranks", "zeroed",
        "weights", "min_share", "data_aware", "interference",
    )  # fmt: skip
    out = {k: _io.to_jsonable(getattr(report, k, None)) for k in keep}
    label = (lambda i: int(i)) if names is None else (lambda i: names[int(i)])
    if coverage is not None:
        out["coverage"] = {str(n): [label(i) for i in t] for n, t in coverage.items()}
    head: dict[str, Any] = {
        "netutility_version": __version__,
        "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "adapters": list(adapters),
    }
    if names is not None:
        shares = report_shares(report)
        cand = None
        if report.masks is not None:
            from ..allocation._min_share import candidates

            counts = candidates(report.scores if report.scores is not None else report.masks)
            cand = np.sum(list(counts.values()), axis=0)
        weights = report.weights or (1.0,) * len(names)
        head["tasks"] = [
            {
                "name": n,
                "path": p,
                "weight": float(weights[i]),
                "kept": int(report.kept_per_task[i]),
                "uniform_share": None if shares is None else float(shares[i]),
                "candidates": None if cand is None else int(cand[i]),
            }
            for i, (n, p) in enumerate(zip(names, adapters, strict=True))
        ]
    out = {**head, "options": _io.to_jsonable(options), **out}
    if config is not None:
        out["config"] = _io.to_jsonable(dict(config))
    return out


def model_card(rep: Mapping[str, Any], base_config: Mapping[str, Any] | None) -> str:
    """The merged adapter's ``README.md``, as PEFT writes one: YAML front matter
    (``library_name: peft``, ``base_model`` if the adapters name one, tags), then what was
    merged (the tasks, their weights and kept directions), how (method, space, allocation,
    budget), and the library's version. ``rep``: :func:`report_dict`'s dict."""
    base = (base_config or {}).get("base_model_name_or_path")
    front = ["---", "library_name: peft"]
    if isinstance(base, str) and base:
        front.append(f"base_model: {json.dumps(base)}")
    front += ["tags:", "- lora", "- merge", "- netutility-jax", "---", ""]
    tasks = rep.get("tasks") or [
        {"name": a, "path": a, "weight": 1.0, "kept": k, "uniform_share": None}
        for a, k in zip(rep["adapters"], rep["kept_per_task"], strict=True)
    ]
    how = f"method `{rep['method']}` in `{rep['space']}` space"
    if rep["allocation"] == "all":
        how += ", every singular direction of every task kept (allocation `all`)"
    else:
        scope = f", {rep['scope']} scope" if rep.get("scope") else ""
        how += (
            f", allocation `{rep['allocation']}`{scope} with a budget of {rep['budget']} "
            f"directions per module on average ({rep['budget_spent']:.2f} spent)"
        )
        if rep.get("min_share"):
            how += f", each task at least {rep['min_share']:g} of its uniform share"
    lines = [
        "# Merged LoRA adapter",
        "",
        f"A merge of {len(tasks)} LoRA adapter{'s' if len(tasks) != 1 else ''}"
        + (f" of `{base}`" if isinstance(base, str) and base else "")
        + f" made with netutility-jax {rep.get('netutility_version', '')}: {how}.",
        "",
        "| task | adapter | weight | kept directions | uniform share |",
        "|---|---|---|---|---|",
    ]
    for t in tasks:
        share = "" if t.get("uniform_share") is None else f"{t['uniform_share']:.1f}"
        lines.append(f"| {t['name']} | `{t['path']}` | {t['weight']:g} | {t['kept']} | {share} |")
    lines += [
        "",
        "Load it with PEFT:",
        "",
        "```python",
        "from peft import PeftModel",
        "",
        'model = PeftModel.from_pretrained(base_model, "path/to/this/folder")',
        "```",
        "",
        f"`{REPORT_NAME}` holds the full report and the configuration: "
        f"`netutility merge --config {REPORT_NAME} --out NEW_DIR` replays the merge.",
        "",
        "### Framework versions",
        "",
        f"- netutility-jax {rep.get('netutility_version', '')}",
        "",
    ]
    return "\n".join(front + lines)


def staging_name(out: pathlib.Path) -> pathlib.Path:
    """A fresh path beside ``out`` to assemble the merge in:
    ``.<name>.netutility-staging-<host>-<pid>-<8 hex digits>`` (not created)."""
    name = out.name
    while len(os.fsencode(name)) > 100:  # (room for the suffix within 255 bytes)
        name = name[:-1]
    prefix = f".{name}.{STAGING_TAG}-{_io.host_tag()}-{os.getpid()}-"
    while True:
        path = out.parent / f"{prefix}{secrets.token_hex(4)}"
        if not os.path.lexists(path):
            return path


def write_error(out: str, e: OSError, terms: Terms | None = None) -> FileAccessError:
    """A failed write of ``out`` as the library's error, naming the file."""
    where = f" at {e.filename}" if getattr(e, "filename", None) else ""
    flag = (terms or Terms()).spell("out")
    return FileAccessError(
        f"{flag} {out}: writing the result failed{where} ({e.strerror or e}); nothing was written. "
        f"Check the free space and permissions, or choose another {flag}."
    )


def appeared(run: Run) -> PathExistsError | None:
    """``out`` appeared while the merge ran (nothing may be written over it), or None."""
    if not os.path.lexists(run.out):
        return None
    return PathExistsError(
        f"{run.t('out')} {run.out_text}: appeared while merging; nothing was written."
    )


@contextlib.contextmanager
def assembled(run: Run) -> Iterator[pathlib.Path]:
    """The output folder assembled: yields a staging folder beside ``out``, which is renamed
    into place when the block ends (complete or not at all; removed if it raises); a failed
    write is the library's :class:`FileAccessError`."""
    out = run.out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = staging_name(out)
    except OSError as e:
        raise write_error(run.out_text, e, run.terms) from e
    try:
        with _io.atomic_directory(out, fn=run.terms.fn, staging=staging) as tmp:
            yield tmp
            err = appeared(run)
            if err is not None:
                raise err
        step(run.bar, "done")
    except OSError as e:
        if not isinstance(e, NetUtilityError):
            raise write_error(run.out_text, e, run.terms) from e
        raise


def write_merge(run: Run, result: Merged) -> None:
    """The writing step of a merge done in memory: the output folder assembled
    (:func:`assembled`) from ``result`` (:func:`write_output`)."""
    with assembled(run) as tmp:
        write_output(tmp, run, result)


def write_output(tmp: pathlib.Path, run: Run, result: Merged) -> None:
    """The merge's output folder, assembled in ``tmp``: the PEFT adapter, the JSON report and
    the plots."""
    from .. import peft

    cfg = run.config
    if cfg.serving_ranks is not None:  # (refused in the caller's terms, not save_adapter's)
        uniform_rank(run, result.report.ranks)
    peft.save_adapter(
        result.merged,
        tmp / "adapter",
        rank=cfg.rank,
        base_config=result.loaded.config,
        dtype=cfg.dtype,
        serving_ranks=cfg.serving_ranks,
    )
    finish_output(tmp, run, result)


def finish_output(tmp: pathlib.Path, run: Run, result: Merged) -> None:
    """The adapter written in ``tmp / "adapter"`` moved up into ``tmp``, then the extras."""
    adapter_dir = tmp / "adapter"
    for f in adapter_dir.iterdir():
        f.rename(tmp / f.name)
    adapter_dir.rmdir()
    step(run.bar, "saved adapter", "writing the report")
    write_extras(tmp, run, result)


def write_extras(tmp: pathlib.Path, run: Run, result: Merged) -> None:
    """The JSON report, the model card (``README.md``) and the plots, in ``tmp``."""
    rep = report_dict(
        result.report, adapters=run.paths, options=_run_options(run, result),
        coverage=result.loaded.coverage, names=run.names, config=recorded_config(run),
    )  # fmt: skip
    _io.write_json(tmp / REPORT_NAME, rep)
    with _io.atomic_file(tmp / "README.md", "w") as f:
        f.write(model_card(rep, result.loaded.config))
    step(run.bar, "wrote report", "plotting")
    if not run.config.no_plots:
        write_plots(tmp / "plots", result.report, len(run.paths), names=run.names)
        step(run.bar, "plots", "moving into place")


def _run_options(run: Run, result: Merged) -> dict[str, Any]:
    """The report's ``options``: the settings the merge ran with."""
    cfg = run.config
    return {
        "command": "merge",
        "budget": cfg.budget,
        "coef": cfg.coef,
        "seed": cfg.seed if result.key is not None else None,
        "rank": cfg.rank,
        "serving_ranks": cfg.serving_ranks,
        "positive_only": not cfg.keep_nonpositive,
        "strict_targets": cfg.strict_targets,
        "allow_different_base": cfg.allow_different_base,
        "skip_non_lora": cfg.skip_non_lora,
        "streamed": hasattr(result.loaded, "read"),
        "chunk_mb": cfg.chunk_mb,
        "processes": run.processes,
        "keep_shards": run.keep_shards,
        "weights": None if cfg.weights is None else list(cfg.weights),
        "min_share": cfg.min_share,
        **cfg.method_options,
    }


def recorded_config(run: Run) -> dict[str, Any]:
    """The configuration that replays this merge, for the report: the adapters (absolute
    paths, weights, names, the Hub id and commit of one read from the Hub cache, and the
    SHA-256 of each folder's files, which a replay checks), then every setting
    (:meth:`MergeConfig.to_dict` with the method's options' defaults filled in and each moments
    file pinned to the digest of the bytes the merge read). ``out`` is not recorded: a replay
    writes a new folder. A folder whose files changed while the merge ran is refused."""
    from .. import hub

    cfg = run.config
    weights = cfg.weights or (1.0,) * len(run.paths)
    before = run.digests or [None] * len(run.paths)
    adapters = []
    for p, w, n, was in zip(run.paths, weights, run.names, before, strict=True):
        item: dict[str, Any] = {"path": os.path.abspath(p), "weight": float(w), "name": n}
        snapshot = hub.from_snapshot(item["path"])
        if snapshot is not None:  # (a replay reads the folder, or id@commit if it is gone)
            item["hub"] = {"id": snapshot.repo_id, "commit": snapshot.commit}
        item["sha256"] = sha = adapter_digest(item["path"], f"adapter {n}")
        if was is not None and was != sha:
            raise InputError(
                f"adapter {n} at {item['path']}: its files changed while the merge ran "
                f"(SHA-256 {was[:16]}... before, {sha[:16]}... after); nothing was "
                "written: run the merge again once they are settled."
            )
        adapters.append(item)
    moments = None
    if run.moments is not None:
        moments = tuple(
            None if m is None else MomentsFile(os.path.abspath(m.path), m.sha256)
            for m in run.moments
        )
    pinned = dataclasses.replace(
        cfg, weights=None, names=None, method_options=cfg.resolved_options(), input_moments=moments
    )
    return {"adapters": adapters, **pinned.to_dict()}


def write_plots(
    folder: pathlib.Path, report: Any, m_tasks: int, *, names: Sequence[str] | None = None
) -> None:
    """The merge's plots in ``folder``, the tasks by ``names`` (default ``task 0`` ...)."""
    from .. import plots

    folder.mkdir()
    names = [f"task {i}" for i in range(m_tasks)] if names is None else list(names)
    plots.budget_heatmap(report.masks, path=folder / "budget_heatmap.png")
    plots.kept_per_task(report.masks, names, path=folder / "kept_per_task.png")
    if report.scores is not None:
        plots.prefix_retention(report.masks, report.scores, path=folder / "prefix_retention.png")
        plots.utility_distribution(
            report.scores, report.masks, names, path=folder / "utility_distribution.png"
        )


def uniform_rank(run: Run, ranks: Mapping[str, int | None]) -> int | None:
    """The serving rank for the merged ``ranks`` of every module, as
    :func:`nu.peft.save_adapter` picks it (a rank-0 module is written at rank 1)."""
    from .. import peft

    allowed = peft.serving_ranks(run.config.serving_ranks, fn=run.terms.fn) or ()
    top = max(max(1, r or 0) for r in ranks.values())
    fits = [r for r in allowed if r >= top]
    if allowed and not fits:
        raise InputError(
            f"{run.t('serving_ranks')}: a merged module has rank {top}, above every allowed "
            f"serving rank {allowed}; lower {run.t('budget')} (or {run.t('rank')}) or allow a "
            "larger rank."
        )
    return fits[0] if fits else None
