"""The NLI head formulation's export (:mod:`nli_head`): an adapter with a head as a PEFT folder.

An adapter (a task's, or a merge) with one task's head is written as a PEFT folder that
``peft.PeftModel.from_pretrained`` loads on ``Qwen3ForSequenceClassification``
(``num_labels=3``): the LoRA factors by ``nu.peft.save_adapter`` and the head as PEFT saves a
``modules_to_save`` module, ``base_model.model.score.weight`` ``(3, D)``, with
``"modules_to_save": ["score"]`` and ``"task_type": "SEQ_CLS"`` (:func:`export_peft`).
:func:`load_peft` reads such a folder back.
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from ...errors import InputError
from ..harness import fitting as ft
from ..harness import records
from ..models import llama
from .nli_head_train import HeadedTask, load_cached

__all__ = [
    "export_merged",
    "export_peft",
    "export_run",
    "load_peft",
]

_SCORE_KEY = "base_model.model.score.weight"


def export_peft(
    adapter: Mapping[str, Any] | HeadedTask,
    path: str | os.PathLike,
    *,
    score: Any = None,
    **config: Any,
) -> dict[str, Any]:
    """Write an adapter and one task's head as a PEFT folder for ``*ForSequenceClassification``.

    The LoRA modules are written by ``nu.peft.save_adapter`` under transformers' names
    (``llama.peft_names``; ``task_type="SEQ_CLS"`` unless ``config`` says otherwise), and the
    head as PEFT saves a ``modules_to_save`` copy: ``base_model.model.score.weight`` ``(C, D)``
    float32 with ``"modules_to_save": ["score"]``. ``PeftModel.from_pretrained(
    Qwen3ForSequenceClassification.from_pretrained(base, num_labels=3), path)`` then computes
    this module's logits (before the mask of a binary task's unused class).

    Args:
      adapter: a :class:`HeadedTask` (its adapter and head), or an adapter (e.g. a merge) with
        ``score``.
      path: the folder (must not exist, or be empty).
      score: ``(D, C)`` the head, when ``adapter`` is not a :class:`HeadedTask`.
      **config: ``nu.peft.save_adapter``'s config fields (``base_model_name_or_path``, ``dtype``
        of the factors, ...).

    Returns:
      The config written to ``adapter_config.json``.
    """
    import netutility_jax as nu

    fn = "nli_head.export_peft"
    if isinstance(adapter, HeadedTask):
        adapter, score = adapter.adapter, adapter.score if score is None else score
    if score is None:
        raise InputError(f"{fn}: pass the task's head (score=) with a bare adapter.")
    w = np.asarray(score, np.float32)
    if w.ndim != 2 or w.shape[1] < 2:
        raise InputError(f"{fn}: score has shape {w.shape}; expected (D, C) with C >= 2 classes.")
    out = pathlib.Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{fn}: {out} exists and is not an empty folder; choose another.")
    from safetensors import flax as stf

    with tempfile.TemporaryDirectory() as tmp:
        cfg = nu.peft.save_adapter(
            llama.peft_names(dict(adapter)), pathlib.Path(tmp) / "lora",
            **{"task_type": "SEQ_CLS", **config},
        )  # fmt: skip
        tensors = dict(stf.load_file(str(pathlib.Path(tmp) / "lora" / nu.peft.WEIGHTS_NAME)))
    tensors[_SCORE_KEY] = jnp.asarray(np.ascontiguousarray(w.T))
    cfg = {**cfg, "modules_to_save": ["score"]}
    with records.atomic_directory(out, fn=fn) as tmp_out:
        stf.save_file(tensors, str(tmp_out / nu.peft.WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp_out / nu.peft.CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
    return cfg


def load_peft(path: str | os.PathLike) -> tuple[dict[str, dict[str, Any]], np.ndarray]:
    """``(adapter, score)`` of a PEFT sequence-classification folder (:func:`export_peft`'s, or
    one PEFT trained): the LoRA modules under ``nu.nnx.extract_adapter`` names and the head
    ``(D, C)`` float32.

    Raises:
      InputError: no ``score`` in ``modules_to_save`` weights, or one of another class count.
    """
    from safetensors import numpy as stn

    import netutility_jax as nu

    d = pathlib.Path(path)
    adapter = llama.nnx_names(nu.peft.load_adapter(d, strict=False))
    keys = {k for k in stn.load_file(str(d / nu.peft.WEIGHTS_NAME)) if k.endswith("score.weight")}
    if _SCORE_KEY not in keys:
        raise InputError(
            f"nli_head.load_peft: {d} holds no head ({_SCORE_KEY}); it has {sorted(keys) or 'none'}."
        )
    w = np.asarray(stn.load_file(str(d / nu.peft.WEIGHTS_NAME))[_SCORE_KEY], np.float32)
    if w.ndim != 2 or w.shape[0] < 2:
        raise InputError(
            f"nli_head.load_peft: {d}: the head has shape {w.shape}; expected (C, D) with C >= 2 "
            "classes."
        )
    return {k: dict(v) for k, v in adapter.items()}, np.ascontiguousarray(w.T)


def export_run(
    fn: str,
    suite: str,
    run_: Any,
    out: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    **config: Any,
) -> list[pathlib.Path]:
    """Write every trained adapter of a run of ``suite``, with its head, as a PEFT folder
    ``<out>/seed<S>/<task>`` (:func:`export_peft`), read back from ``<cache_dir>/<suite>``, the
    cache the run used (``fn`` names the public call in messages).

    Raises:
      InputError: an adapter is no longer in the cache.
    """
    base = (pathlib.Path(cache_dir) if cache_dir is not None else ft.default_cache_dir()) / suite
    return ft.export_cached(
        fn, run_, out, base, load_cached,
        lambda trained, path: export_peft(trained, path, **config),
    )  # fmt: skip


def export_merged(
    merged: Mapping[str, Any],
    trained: Sequence[HeadedTask],
    out: str | os.PathLike,
    **config: Any,
) -> list[pathlib.Path]:
    """Write a merged adapter once per task, each with that task's head:
    ``<out>/<task>/`` (:func:`export_peft`), as the merged model is evaluated."""
    written = []
    for t in trained:
        p = pathlib.Path(out) / t.name
        export_peft(merged, p, score=t.score, **config)
        written.append(p)
    return written
