"""Evaluation of the language suite: label scoring with the LM head, merges folded into the kernels.

**Scoring** (:class:`Scorer`): a prompt's logits are the LM head's scores of the label words'
first tokens at the last prompt position (``llama.last_token_logits`` with ``token_ids``): the
``V``-wide head product is never formed, and the model's work is the prompt's forward pass. A
:class:`lang_tasks.PromptSet` of several tasks is scored in one pass over its batches (the
columns of every task's label tokens at once); each prompt's prediction is the argmax over its
own task's columns.

**Merges are folded.** A merged adapter is evaluated as it would be served: its dense update
``dK`` per module is formed once per merge (:meth:`Scorer.deltas`), and once per coefficient
the adapted kernels ``W + coef * dK`` are computed by one jitted call (:meth:`Scorer.fold`);
the forward then runs the plain base model on those kernels. No LoRA branch runs, and a new
coefficient or merge never recompiles (one compilation per batch shape).

**Evaluator** (:class:`Evaluator`): the single-LoRA accuracies (each task's adapter on its own
prompts: the normalizers), the zero-shot accuracies, and per merge the coefficient search on
validation and one test pass, with the interface and results (``evaluate.MergeEval``) of
``encoder_eval.Evaluator``, so ``runner`` and ``report`` treat both suites alike. Zero-shot and
single-LoRA correctness are cached on disk when a cache folder is given
(:func:`cached_correct`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...errors import InputError
from ..data import lang_tasks as lt
from ..harness import evaluate as ev
from ..harness import records
from ..harness.evaluate import module_delta as module_delta
from ..harness.passes import PassCounter
from ..models import llama

__all__ = [
    "CODE_VERSION",
    "Evaluator",
    "Scorer",
    "cached_correct",
    "model_fingerprint",
    "module_delta",
    "zero_shot_accuracy",
    "zero_shot_correct",
]

#: Bump when a change here changes what an evaluation produces: invalidates cached correctness.
CODE_VERSION = 1


def _target_filter(targets: Sequence[str]) -> Callable[[tuple, Any], bool]:
    names = set(targets)

    def is_target(path: tuple, _: Any) -> bool:
        return len(path) >= 2 and path[-1] == "kernel" and str(path[-2]) in names

    return is_target


def model_fingerprint(model: llama.Llama) -> str:
    """sha256 of the model's config and every weight (names, shapes, dtypes and bytes)."""
    h = hashlib.sha256(repr(model.config).encode())
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        x = np.asarray(var.get_value())
        h.update(f"{'/'.join(map(str, path))}:{x.shape}:{x.dtype}".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


class Scorer(PassCounter):
    """The frozen base decoder, scoring prompt sets with a merged adapter folded into its kernels.

    Args:
      model: a :class:`llama.Llama` without adapters.
      targets: the adapted projections (default q, k, v, o of every layer).

    Attributes:
      module_names: adapter module names this model takes, ``"model/layers/{i}/self_attn/q_proj"``
        (``nu.nnx.extract_adapter`` names; PEFT names ``"model.layers.0..."`` are accepted too).
      passes, tokens, slot_tokens, seconds: work done so far (prompt passes, prompt tokens,
        tokens computed with padding, wall seconds).
    """

    def __init__(self, model: llama.Llama, *, targets: Sequence[str] = llama.LORA_TARGETS):
        if not isinstance(model, llama.Llama):
            raise InputError(f"Scorer: model is a {type(model).__name__}; expected a llama.Llama.")
        if model.lora is not None:
            raise InputError(
                "Scorer: the model has LoRA adapters; pass the base model (llama.from_gguf() "
                "without lora=), adapters are folded into its kernels."
            )
        self.model = model
        self.config = model.config
        self.graphdef, self.kernels, self.rest = nnx.split(model, _target_filter(targets), ...)
        flat = list(nnx.to_flat_state(self.kernels))
        self._paths = [p for p, _ in flat]
        self.module_names = tuple("/".join(map(str, p[:-1])) for p in self._paths)
        self._shapes = {
            n: tuple(v.get_value().shape) for n, (_, v) in zip(self.module_names, flat, strict=True)
        }
        self._index = {n: i for i, n in enumerate(self.module_names)}
        graphdef = self.graphdef

        def fold(kernels, deltas, coef):
            return jax.tree.map(
                lambda w, d: (w.astype(jnp.float32) + coef * d).astype(w.dtype), kernels, deltas
            )

        def score(kernels, rest, ids, mask, token_ids):
            m = nnx.merge(graphdef, kernels, rest)
            return llama.last_token_logits(m, ids, mask, token_ids=token_ids)

        self._fold = jax.jit(fold)
        self._score = jax.jit(score)

    def _name(self, name: str) -> str:
        if name in self._index:
            return name
        alt = name.removeprefix("base_model.model.").replace(".", "/")
        if alt in self._index:
            return alt
        raise InputError(
            f"Scorer: adapter module {name!r} is not a LoRA target of the model; expected names "
            f"like {self.module_names[0]!r} (or the PEFT name "
            f"{self.module_names[0].replace('/', '.')!r})."
        )

    def deltas(self, adapter: Mapping[str, Any] | None) -> Any:
        """The dense updates of ``adapter`` as a state shaped like the adapted kernels.

        A module the adapter lacks adds nothing; None: no adapter at all.

        Raises:
          InputError: a module name that is not a target, or a module of another shape.
        """
        out = [np.zeros(self._shapes[n], np.float32) for n in self.module_names]
        for name, mod in (adapter or {}).items():
            k = self._index[self._name(name)]
            d = module_delta(mod)
            if d.shape != self._shapes[self.module_names[k]]:
                raise InputError(
                    f"Scorer: adapter module {name!r} has an update of shape {d.shape} but the "
                    f"model's kernel there is {self._shapes[self.module_names[k]]}; the adapter "
                    "was trained on another model."
                )
            out[k] = d
        flat = nnx.to_flat_state(self.kernels)
        return nnx.from_flat_state(
            [(p, v.replace(jnp.asarray(d))) for (p, v), d in zip(flat, out, strict=True)]
        )

    def fold(self, deltas: Any, coef: float = 1.0) -> Any:
        """The adapted kernels ``W + coef * dK`` (one jitted call)."""
        return self._fold(self.kernels, deltas, jnp.asarray(coef, jnp.float32))

    def logits(
        self,
        ps: lt.PromptSet,
        adapter: Mapping[str, Any] | None = None,
        coef: float = 1.0,
        *,
        deltas: Any = None,
        kernels: Any = None,
    ) -> np.ndarray:
        """``(N, K)`` float32 scores of ``ps.token_ids`` after each prompt of ``ps``.

        The model is the base plus ``coef * adapter`` (or ``coef * deltas``, from
        :meth:`deltas`; or the given adapted ``kernels``, from :meth:`fold`).
        """
        t0 = time.perf_counter()
        if kernels is None:
            if deltas is None and adapter is None:
                kernels = self.kernels
            else:
                kernels = self.fold(self.deltas(adapter) if deltas is None else deltas, coef)
        tok = jnp.asarray(ps.token_ids)
        pending = [
            (b.index, self._score(kernels, self.rest, b.ids, b.mask, tok)) for b in ps.batches
        ]
        return self.gather(pending, (len(ps), len(ps.token_ids)), ps, t0)

    def correct(self, ps: lt.PromptSet, adapter=None, coef: float = 1.0, **kw) -> np.ndarray:
        """``(N,)`` bool: each prompt answered right (argmax over its task's label tokens)."""
        return ps.predict(self.logits(ps, adapter, coef, **kw)) == ps.labels


# ------------------------------------------------------------------------------------ caching


def cached_correct(
    cache_dir: str | os.PathLike | None, what: Mapping[str, Any], compute: Callable[[], np.ndarray]
) -> tuple[np.ndarray, bool]:
    """A correctness vector from ``<cache_dir>/correct/<key>.npz``, else ``compute()`` stored there.

    ``what`` (JSON) names everything that determines the result; its hash is the key. The file
    is written to a temporary name and renamed into place. Returns ``(correct, cache_hit)``.
    """
    if cache_dir is None:
        return np.asarray(compute(), bool), False
    what = {"code_version": CODE_VERSION, **what}
    key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()
    path = pathlib.Path(cache_dir) / "correct" / f"{what.get('kind', 'eval')}-{key[:24]}.npz"
    if path.exists():
        try:
            with np.load(path, allow_pickle=False) as z:
                return np.unpackbits(z["correct"])[: int(z["n"])].astype(bool), True
        except (OSError, ValueError, KeyError):
            pass
    ok = np.asarray(compute(), bool)
    path.parent.mkdir(parents=True, exist_ok=True)
    with records.atomic_file(path, "wb") as f:
        np.savez(f, correct=np.packbits(ok), n=np.asarray(len(ok)))
    return ok, False


def zero_shot_correct(
    scorer: Scorer,
    ps: lt.PromptSet,
    *,
    cache_dir: str | os.PathLike | None = None,
    weights: str | None = None,
) -> np.ndarray:
    """``(N,)`` bool correctness of the base model (no adapter) on ``ps``, cached.

    ``weights``: the model's fingerprint for the cache key (default computed,
    :func:`model_fingerprint`).
    """
    what = {
        "kind": "zero_shot",
        "weights": weights or model_fingerprint(scorer.model),
        "prompts": ps.fingerprint(),
    }
    return cached_correct(cache_dir, what, lambda: scorer.correct(ps))[0]


def zero_shot_accuracy(
    scorer: Scorer,
    ps: lt.PromptSet,
    *,
    cache_dir: str | os.PathLike | None = None,
    weights: str | None = None,
) -> dict[str, float]:
    """The base model's accuracy per task on ``ps`` (``{task: fraction right}``), cached."""
    ok = zero_shot_correct(scorer, ps, cache_dir=cache_dir, weights=weights)
    return ev.accuracies(ok, ps)


# ---------------------------------------------------------------------------------- evaluator


class Evaluator(ev.MergeSearch):
    """Single-LoRA, zero-shot and merged accuracies on val and test (``encoder_eval.Evaluator``'s
    interface for the language suite; the coefficient search is ``evaluate.MergeSearch``).

    Args:
      scorer: a :class:`Scorer`.
      adapters: one LoRA adapter per task, in ``val.task_names`` order.
      val, test: :class:`lang_tasks.PromptSet` of the same tasks (validation: coefficient
        search; test: reported once per merge).
      cache_dir: where zero-shot and single-LoRA correctness are cached (None: not cached).
      adapter_keys: one cache key per adapter (its training cache key); needed to cache the
        single-LoRA results.
      weights: the model's fingerprint (default computed when caching).
    """

    def __init__(
        self,
        scorer: Scorer,
        adapters: Sequence[Mapping[str, Any]],
        val: lt.PromptSet,
        test: lt.PromptSet,
        *,
        cache_dir: str | os.PathLike | None = None,
        adapter_keys: Sequence[str] | None = None,
        weights: str | None = None,
    ):
        if val.task_names != test.task_names:
            raise InputError(
                f"Evaluator: validation tasks {val.task_names} differ from test tasks "
                f"{test.task_names}."
            )
        if len(adapters) != len(val.task_names):
            raise InputError(
                f"Evaluator: {len(adapters)} adapters for {len(val.task_names)} tasks; pass one "
                "adapter per task, in the prompt sets' task order."
            )
        if adapter_keys is not None and len(adapter_keys) != len(adapters):
            raise InputError(
                f"Evaluator: {len(adapter_keys)} adapter keys for {len(adapters)} adapters."
            )
        self.scorer, self.adapters = scorer, list(adapters)
        self.val, self.test = val, test
        self.task_names = val.task_names
        if cache_dir is not None and weights is None:
            weights = model_fingerprint(scorer.model)
        self._cache, self._keys, self._weights = cache_dir, adapter_keys, weights
        self.single_val_correct = self._single(val)
        self.single_test_correct = self._single(test)
        self.single_val = ev.accuracies(self.single_val_correct, val)
        self.single_test = ev.accuracies(self.single_test_correct, test)
        zs_val = zero_shot_correct(scorer, val, cache_dir=cache_dir, weights=weights)
        self.zero_shot_test_correct = zero_shot_correct(
            scorer, test, cache_dir=cache_dir, weights=weights
        )
        self.zero_shot_val = ev.accuracies(zs_val, val)
        self.zero_shot_test = ev.accuracies(self.zero_shot_test_correct, test)

    def _single(self, ps: lt.PromptSet) -> np.ndarray:
        ok = np.zeros(len(ps), bool)
        for i in range(len(self.task_names)):
            sub = ps.only(i)
            if self._keys is None:
                ok[ps.rows(i)] = self.scorer.correct(sub, self.adapters[i])
                continue
            what = {
                "kind": "single",
                "adapter": self._keys[i],
                "weights": self._weights,
                "prompts": sub.fingerprint(),
            }
            ok[ps.rows(i)] = cached_correct(
                self._cache, what, lambda sub=sub, i=i: self.scorer.correct(sub, self.adapters[i])
            )[0]
        return ok

    def correct(self, ps: lt.PromptSet, adapter=None, coef: float = 1.0, *, deltas=None):
        """``(N,)`` bool correctness on ``ps`` of the base model plus ``coef * adapter``."""
        return self.scorer.correct(ps, adapter, coef, deltas=deltas)

    def deltas(self, adapter: Mapping[str, Any]) -> Any:
        """The merge's updates as the scorer folds them (``Scorer.deltas``)."""
        return self.scorer.deltas(adapter)
