"""The paper's NLI formulation (Appendix B): a decoder with a three-way sequence-classification head.

**The model** (as transformers' ``Qwen3ForSequenceClassification`` /
``LlamaForSequenceClassification``, which the paper trains through PEFT): a premise-hypothesis
pair is encoded jointly (:func:`encode_pairs`: the tokenizer's pair encoding, as
``tokenizer(premise, hypothesis, truncation=True, max_length=...)``; Qwen3's tokenizer adds no
special tokens, so the two token sequences are concatenated), the decoder's final-normed hidden
state at the **last real token** is pooled (:func:`pool_last`; transformers pools the last token
that is not the pad id, the same token for right-padded rows) and a linear ``score`` head without
bias, ``D x 3``, gives the logits over the unified label space (entailment, neutral,
contradiction; :data:`nli_data.LABELS`). For a binary task (QNLI, RTE: not-entailment is class
2; SciTail: neutral is class 1) the unused class's logit is set to :data:`MASK_LOGIT`
(``-1e10``, the paper's value) before the loss and at evaluation (:func:`class_logits`), so it
is never predicted and takes no probability, hence no gradient.

**Training** (:class:`Trainer`; defaults :class:`NLITrainConfig` are Appendix B's table):
LoRA ``r = 16``, ``alpha = 16`` on ``q_proj, k_proj, v_proj, o_proj`` of every layer with
dropout 0.1 on the LoRA branch's input (PEFT's ``lora_dropout``: ``x W + s B A dropout(x)``,
:class:`DropoutLoRALinear`), the head trained with it (PEFT's ``modules_to_save``), the base
frozen; AdamW at ``3e-5``, linear schedule with 6% warmup, batch 1, at most 10 epochs,
validation accuracy every 4,000 steps, the best checkpoint kept, early stopping after 3
evaluations without improvement (:class:`trainer.LoraTrainer`). What the paper leaves
unsaid is ours, and follows transformers' ``Trainer`` defaults (our reading: evaluation every
4,000 steps with a patience of 3 is that ``Trainer`` with its ``EarlyStoppingCallback``):
weight decay 0, gradient clipping at global norm 1 (:func:`clip_gradient`), warmup of
``ceil(0.06 T)`` steps over the ``T`` steps of 10 epochs, the same initial LoRA ``A`` and head
for every task (``init="shared"``: one seed, as a training script seeds once); the head starts
as transformers initialises ``score`` (normal, std 0.02).

**Evaluation** (:class:`Scorer`, :class:`Evaluator`): a merged adapter is folded into the base
kernels once per coefficient (``lang_eval.Scorer``'s fold: no LoRA branch runs), the pairs of
every task go through jitted batches sorted by length (one shape per length bucket
:func:`bucket_len` and rows per batch from ``eval_tokens``), and **each task is read by its own
trained head** (the heads are stacked; each row picks its task's). The single-LoRA accuracies
(each task's adapter and head) are the normalizers; the "zero-shot" floor is the base model with
each task's trained head and no LoRA.

**Export** (:func:`export_peft`): an adapter (a task's, or a merge) with one task's head is
written as a PEFT folder that ``peft.PeftModel.from_pretrained`` loads on
``Qwen3ForSequenceClassification`` (``num_labels=3``): the LoRA factors by
``nu.peft.save_adapter`` and the head as PEFT saves a ``modules_to_save`` module,
``base_model.model.score.weight`` ``(3, D)``, with ``"modules_to_save": ["score"]`` and
``"task_type": "SEQ_CLS"``. :func:`load_peft` reads such a folder back.

References:
  Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022. Qwen Team, "Qwen3
  Technical Report", 2025. Bowman et al. (SNLI) 2015; Williams et al. (MNLI) 2018; Marelli et al.
  (SICK) 2014; Wang et al. (GLUE: QNLI, RTE) 2019; Khot et al. (SciTail) 2018.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ...errors import InputError, InputTypeError
from ..data import lang_tasks as lt
from ..data import nli_data as nd
from ..harness import evaluate as ev
from ..harness import fitting as ft
from ..harness import records
from ..harness.passes import PassCounter, TaskSet
from ..harness.trainer import Batch, LoraTrainer, TaskRun, lora_state, train_cached
from ..models import llama
from ..models.llama_model import variable_at
from ..models.minilm_model import LoRALinear
from . import lang_eval as le
from . import lang_train as ltr

__all__ = [
    "CODE_VERSION",
    "MASK_LOGIT",
    "NO_STEP_CAP",
    "NUM_CLASSES",
    "DropoutKey",
    "DropoutLoRALinear",
    "Encoded",
    "Evaluator",
    "HeadSpec",
    "HeadedTask",
    "NLISet",
    "NLITrainConfig",
    "Scorer",
    "Trainer",
    "bucket_len",
    "cache_key",
    "class_logits",
    "clip_gradient",
    "encode_pairs",
    "export_merged",
    "export_peft",
    "export_run",
    "head_spec",
    "load_cached",
    "load_peft",
    "make_set",
    "masked_loss",
    "pool_last",
    "train_batch",
    "train_task",
    "train_tasks",
    "used_mask",
    "with_lora_dropout",
]

#: Bump when a change here changes what training or evaluation produces: invalidates the caches.
CODE_VERSION = 1
#: Classes of the NLI suite's unified label space (:data:`nli_data.LABELS`); a head of another
#: suite may have any number (its :class:`HeadSpec`'s ``used`` gives it: :func:`num_classes`).
NUM_CLASSES = len(nd.LABELS)
#: The logit of a task's unused class (Appendix B: "setting its logit to -10^10").
MASK_LOGIT = -1e10
#: ``max_steps`` meaning "no cap but ``max_epochs``".
NO_STEP_CAP = 2**31 - 1
_SCORE_STD = 0.02  # transformers' initializer_range, the init of a fresh ``score`` head


# ------------------------------------------------------------------------------------ config


@dataclasses.dataclass(frozen=True)
class NLITrainConfig(ft.TrainConfigBase):
    """The training of one task's LoRA and head; the defaults are the paper's (App. B).

    The fields of :class:`fitting.TrainConfigBase` (LoRA, AdamW, validation and patience), with
    the paper's values, and:

    Attributes:
      lora_dropout: dropout on the LoRA branch's input (PEFT's ``lora_dropout``).
      rows: pairs per step (the paper's batch size, 1).
      row_len: most tokens of a pair (the paper's maximum sequence length, 2,000; longer pairs
        are cut longest-first, as transformers' ``truncation=True``).
      max_steps: a cap on the steps (:data:`NO_STEP_CAP`: none but ``max_epochs``).
      max_epochs: at most this many passes over the training pairs; the schedule's length is
        ``min(max_steps, max_epochs * ceil(n_train / rows))`` (:meth:`steps_for`).
      max_grad_norm: clip the gradient (LoRA and head together) to this global norm
        (transformers' ``Trainer`` default 1.0; 0: off).
      eval_tokens: token slots per evaluation batch (rows are ``eval_tokens / T`` rounded down to
        a power of two for a bucket of ``T`` tokens).
      seed: data order, dropout masks and initialization.
    """

    lora_rank: int = 16
    lora_alpha: float = 16.0
    lora_dropout: float = 0.1
    rows: int = 1
    row_len: int = 2000
    learning_rate: float = 3e-5
    weight_decay: float = 0.0
    warmup_fraction: float = 0.06
    max_steps: int = NO_STEP_CAP
    max_epochs: int = 10
    eval_every: int = 4000
    patience: int = 3
    init: str = "shared"
    max_grad_norm: float = 1.0
    eval_tokens: int = 16384
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        cls = type(self).__name__
        if not (isinstance(self.lora_dropout, (int, float)) and 0 <= self.lora_dropout < 1):
            raise InputError(f"{cls}: lora_dropout={self.lora_dropout!r}; expected 0 <= p < 1.")
        for name in ("max_epochs", "eval_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"{cls}: {name}={v!r}; expected an integer >= 1.")
        if not (isinstance(self.max_grad_norm, (int, float)) and self.max_grad_norm >= 0):
            raise InputError(
                f"{cls}: max_grad_norm={self.max_grad_norm!r}; expected a number >= 0 (0: off)."
            )

    def schedule(self) -> optax.Schedule:
        """transformers' linear schedule: from 0 up to ``learning_rate`` over
        ``ceil(warmup_fraction * max_steps)`` steps, then linearly down to 0 at ``max_steps``."""
        warm = max(math.ceil(self.warmup_fraction * self.max_steps), 1)
        decay = max(self.max_steps - warm, 1)
        sched = optax.join_schedules(
            [
                optax.linear_schedule(0.0, self.learning_rate, warm),
                optax.linear_schedule(self.learning_rate, 0.0, decay),
            ],
            [warm],
        )
        return lambda step: sched(jnp.asarray(step, jnp.float32))

    def steps_for(self, n_train: int) -> int:
        """The schedule's length for ``n_train`` training pairs."""
        per_epoch = -(-int(n_train) // self.rows)
        return max(1, min(self.max_steps, self.max_epochs * per_epoch))


# ------------------------------------------------------------------------------------- heads


class HeadSpec(NamedTuple):
    """What a task's head reads: its classes in use (the others are masked).

    Attributes:
      task: the task's name.
      used: ``(C,)`` bools, class ``c`` of the label space (:data:`nli_data.LABELS` for the NLI
        suite) in use.
      names: what the task calls each class (``nli_data.UNUSED`` for a masked one).
    """

    task: str
    used: tuple[bool, ...]
    names: tuple[str, ...]


def head_spec(task: Any, labels: Sequence[str] = nd.LABELS) -> HeadSpec:
    """The head of a task in the label space ``labels`` (default the NLI suite's,
    :data:`nli_data.LABELS`, as ``nli_data.load_task`` maps a dataset into it): its classes and
    which are masked (a label text of :data:`nli_data.UNUSED`).

    Raises:
      InputError: the task's labels are not ``labels`` (the heads of all tasks must share one
        label space to be merged), or it uses no class.
    """
    labels = tuple(labels)
    if tuple(task.labels) != labels:
        where = (
            "the NLI suite's tasks share the label space "
            f"{list(nd.LABELS)} (load them with nli_data.load_task, which maps a binary dataset "
            "into it)"
            if labels == nd.LABELS
            else f"the suite's tasks share the label space {list(labels)}"
        )
        raise InputError(
            f"nli_head.head_spec: task {task.name!r} has labels {list(task.labels)}; {where}."
        )
    names = tuple(task.label_texts)
    used = tuple(t != nd.UNUSED for t in names)
    if not any(used):
        raise InputError(f"nli_head.head_spec: task {task.name!r} marks every class unused.")
    return HeadSpec(task.name, used, names)


def num_classes(heads: Sequence[HeadSpec]) -> int:
    """``C``, the classes of the label space every head of ``heads`` reads.

    Raises:
      InputError: no heads, or heads of different class counts (named).
    """
    sizes = {h.task: len(h.used) for h in heads}
    if not sizes or len(set(sizes.values())) != 1:
        raise InputError(
            "nli_head.num_classes: the heads must share one label space; they have "
            f"{sizes or 'no heads'} classes."
        )
    return next(iter(sizes.values()))


def used_mask(heads: Sequence[HeadSpec]) -> np.ndarray:
    """``(T, C)`` bool: the classes each head uses."""
    return np.asarray([h.used for h in heads], bool).reshape(len(heads), num_classes(heads))


def pool_last(hidden: jax.Array, mask: jax.Array) -> jax.Array:
    """``(B, D)``: each row's hidden state at its last real token (``hidden`` ``(B, T, D)``)."""
    idx = llama.last_token_index(mask)
    return jnp.take_along_axis(hidden, idx[:, None, None], axis=1)[:, 0]


def class_logits(
    pooled: jax.Array, scores: jax.Array, head: jax.Array, used: jax.Array
) -> jax.Array:
    """Each row's logits under its task's head, unused classes at :data:`MASK_LOGIT`.

    ``z_b = pooled_b @ scores[head_b]``, then ``z_bc = -1e10`` where ``used[head_b, c]`` is
    False (Appendix B: the unused class of a binary task is masked before the loss and at
    evaluation).

    Args:
      pooled: ``(B, D)`` float32 pooled hidden states.
      scores: ``(T, D, C)`` float32 heads (``score.weight`` transposed), one per task.
      head: ``(B,)`` int32, the head of each row.
      used: ``(T, C)`` bool.

    Returns:
      ``(B, C)`` float32.
    """
    z = jnp.einsum("bd,tdc->btc", pooled, scores, precision=jax.lax.Precision.HIGHEST)
    z = jnp.take_along_axis(z, head[:, None, None], axis=1)[:, 0]
    return jnp.where(used[head], z, MASK_LOGIT)


def masked_loss(logits: jax.Array, labels: jax.Array, valid: jax.Array) -> jax.Array:
    """Mean cross-entropy of the valid rows (``logits`` already masked: a masked class has
    probability 0, so it adds nothing to the loss and gets no gradient)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    w = valid.astype(ce.dtype)
    return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def clip_gradient(tree: Any, max_norm: float) -> Any:
    """The identity whose backward pass clips the cotangent of ``tree`` to global norm
    ``max_norm`` (``torch.nn.utils.clip_grad_norm_``: scaled by ``max_norm / (norm + 1e-6)``
    when that is below 1). Applied to the parameters at the top of a loss, it clips the whole
    gradient before the optimizer sees it, as transformers' ``Trainer`` does."""
    return tree


def _clip_fwd(tree: Any, max_norm: float) -> tuple[Any, None]:
    return tree, None


def _clip_bwd(max_norm: float, _: None, g: Any) -> tuple[Any]:
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(g)))
    factor = jnp.minimum(max_norm / (norm + 1e-6), 1.0)
    return (jax.tree.map(lambda x: x * factor.astype(x.dtype), g),)


clip_gradient.defvjp(_clip_fwd, _clip_bwd)


# ----------------------------------------------------------------------------- LoRA dropout


class DropoutKey(nnx.Variable):
    """The PRNG key (raw ``uint32 (2,)``) a :class:`DropoutLoRALinear` draws its mask from; the
    trainer sets a fresh one for every step."""


class DropoutLoRALinear(LoRALinear):
    """A scaled LoRA layer with dropout on its branch's input, as PEFT's ``lora_dropout``:
    ``y = x W + b + s (dropout(x) A) B``, ``dropout(x) = x * m / (1 - p)``, ``m ~ Bernoulli(1 -
    p)`` drawn from :attr:`dropout_key`. The base product never sees dropout; with ``p = 0`` it
    is ``minilm.LoRALinear``. State: that of ``LoRALinear`` (same paths, so adapters extract and
    export alike) and ``dropout_key``.

    Args:
      in_features, out_features, lora_rank, lora_scale, rngs, **kwargs: as
        ``minilm.LoRALinear``.
      lora_dropout: ``p``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        lora_rank: int,
        lora_scale: float = 1.0,
        lora_dropout: float = 0.0,
        rngs: nnx.Rngs,
        **kwargs: Any,
    ):
        super().__init__(
            in_features, out_features, lora_rank=lora_rank, lora_scale=lora_scale, rngs=rngs,
            **kwargs,
        )  # fmt: skip
        self.lora_dropout = float(lora_dropout)
        self.dropout_key = DropoutKey(jnp.zeros((2,), jnp.uint32))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = nnx.Linear.__call__(self, x)
        p = self.lora_dropout
        if p > 0:
            keep = jax.random.bernoulli(self.dropout_key[...], 1.0 - p, x.shape)
            x = jnp.where(keep, x / (1.0 - p), 0).astype(x.dtype)
        delta = self.lora(x)
        if self.lora.scale != 1.0:
            delta = delta * self.lora.scale
        return y + delta


def with_lora_dropout(model: llama.Llama, rate: float) -> llama.Llama:
    """Give every LoRA layer of ``model`` (a :func:`llama.add_lora` model) dropout ``rate`` on its
    branch's input, in place: each ``LoRALinear`` becomes a :class:`DropoutLoRALinear` holding the
    same arrays. Returns ``model``."""
    if model.lora is None:
        raise InputError("nli_head.with_lora_dropout: the model has no LoRA layers (add_lora).")
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in model.lora.targets:
                old = getattr(parent, name, None)
                if not isinstance(old, LoRALinear) or isinstance(old, DropoutLoRALinear):
                    continue
                rank = int(old.lora.lora_a.get_value().shape[1])
                new = nnx.eval_shape(
                    lambda old=old, rank=rank: DropoutLoRALinear(
                        old.in_features, old.out_features, lora_rank=rank,
                        lora_scale=old.lora.scale, lora_dropout=rate, use_bias=old.use_bias,
                        dtype=old.dtype, param_dtype=old.param_dtype, lora_dtype=old.lora.dtype,
                        rngs=nnx.Rngs(0),
                    )
                )  # fmt: skip
                for path, var in nnx.to_flat_state(nnx.state(old)):
                    variable_at(new, path).set_value(var.get_value())
                new.dropout_key.set_value(jnp.zeros((2,), jnp.uint32))
                setattr(parent, name, new)
    return model


# ---------------------------------------------------------------------------------- encoding


class Encoded(NamedTuple):
    """Token ids of ``N`` pairs, ragged: pair ``i`` is ``flat[offsets[i]:offsets[i + 1]]``."""

    flat: np.ndarray
    offsets: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets).astype(np.int32)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> np.ndarray:
        return self.flat[self.offsets[i] : self.offsets[i + 1]]


@functools.lru_cache(maxsize=8)
def _pair_backend(tokenizer: Any, max_len: int) -> Any:
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_str(tokenizer.backend.to_str())
    backend.no_padding()
    backend.enable_truncation(max_len, strategy="longest_first")
    return backend


def encode_pairs(
    tokenizer: Any, pairs: Sequence[tuple[str, str] | str], *, max_len: int
) -> Encoded:
    """Token ids of ``(premise, hypothesis)`` pairs, as transformers' fast tokenizer encodes
    ``tokenizer(premises, hypotheses, truncation=True, max_length=max_len)``: the tokenizer's
    pair template (its special tokens, if any), longest-first truncation to ``max_len`` tokens.
    A single text (a ``str`` in place of a pair) is encoded alone, as ``tokenizer(text,
    truncation=True, max_length=max_len)``.

    Raises:
      InputError: a pair that encodes to no token; ``max_len`` below the template's special
        tokens.
    """
    if not len(pairs):
        return Encoded(np.zeros(0, np.int32), np.zeros(1, np.int64))
    try:
        enc = _pair_backend(tokenizer, int(max_len)).encode_batch(
            [x if isinstance(x, str) else tuple(x) for x in pairs], add_special_tokens=True
        )
    except Exception as e:  # tokenizers raises bare exceptions (e.g. max_len below specials)
        raise InputError(
            f"nli_head.encode_pairs: tokenizing failed (max_len={max_len}): {e}"
        ) from e
    ids = [e.ids for e in enc]
    empty = [i for i, x in enumerate(ids) if not x]
    if empty:
        raise InputError(
            f"nli_head.encode_pairs: pair {empty[0]} ({pairs[empty[0]]!r}) encodes to no token; "
            "drop empty pairs from the data."
        )
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in ids])]).astype(np.int64)
    return Encoded(np.fromiter((t for x in ids for t in x), np.int32, int(offsets[-1])), offsets)


def bucket_len(n: int) -> int:
    """``n`` rounded up to the next of 16, 24, 32, 48, 64, 96, ... (``8 * 2^k`` and ``12 * 2^k``):
    at most two compiled shapes per doubling of the length, at most a third of padding."""
    n = max(int(n), 1)
    k = 16
    while True:
        if n <= k:
            return k
        if n <= k * 3 // 2:
            return k * 3 // 2
        k *= 2


def _rows_for(t: int, eval_tokens: int) -> int:
    r = max(eval_tokens // t, 1)
    return 1 << (r.bit_length() - 1)


def _eval_batches(
    enc: Encoded, order: np.ndarray, *, eval_tokens: int, pad_id: int
) -> list[lt.PromptBatch]:
    """Pairs (``order``: longest first) cut into batches of ``eval_tokens / T`` rows padded to
    ``T = bucket_len`` of their longest (a short last batch gets filler rows): a batch's shape
    depends on ``T`` only, so every set (and every task's part of it) shares the compilations."""
    lengths = enc.lengths
    out, s = [], 0
    while s < len(order):
        t = bucket_len(int(lengths[order[s]]))
        rows = _rows_for(t, eval_tokens)
        sel = order[s : s + rows]
        ids = np.full((rows, t), pad_id, np.int32)
        mask = np.zeros((rows, t), np.int32)
        index = np.full(rows, -1, np.int32)
        for r, i in enumerate(sel):
            x = enc.row(int(i))
            ids[r, : len(x)] = x
            mask[r, : len(x)] = 1
            index[r] = i
        out.append(lt.PromptBatch(ids, mask, index))
        s += len(sel)
    return out


def train_batch(
    enc: Encoded, labels: np.ndarray, chosen: Sequence[int], *, rows: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, mask, labels, valid)`` of one training step: ``rows`` rows right padded to
    :func:`bucket_len` of the longest chosen pair; missing rows are masked fillers."""
    chosen = np.asarray(chosen, np.int64)
    t = bucket_len(int(enc.lengths[chosen].max()))
    ids = np.full((rows, t), pad_id, np.int32)
    mask = np.zeros((rows, t), np.int32)
    lab = np.zeros(rows, np.int32)
    for r, i in enumerate(chosen):
        x = enc.row(int(i))
        ids[r, : len(x)] = x
        mask[r, : len(x)] = 1
        lab[r] = labels[i]
    return ids, mask, lab, np.arange(rows) < len(chosen)


@dataclasses.dataclass(frozen=True, eq=False)
class NLISet(TaskSet):
    """The pairs of one split of several tasks, tokenized and batched once (the attributes the
    runner, report and statistics read from an ``encoder_eval.EvalSet`` are here too).

    Attributes:
      task_names: the tasks, in the order of the ``task`` indices.
      heads: one :class:`HeadSpec` per task.
      task: ``(N,)`` int32 task of each pair (index into ``task_names``).
      head: ``(N,)`` int32 the head that reads each pair (index into the stacked heads the
        evaluator holds: equal to ``task`` except in a set cut out by :meth:`only`).
      labels: ``(N,)`` int32 classes of :data:`nli_data.LABELS`.
      lengths: ``(N,)`` tokens per pair.
      ids: ``(N, max(lengths))`` int32, right padded.
      batches: the forward calls (``lang_tasks.PromptBatch``: ``ids``, ``mask``, ``index``).
      pad_id: the padding id.
      eval_tokens: token slots per batch.
    """

    task_names: tuple[str, ...]
    heads: tuple[HeadSpec, ...]
    task: np.ndarray
    head: np.ndarray
    labels: np.ndarray
    lengths: np.ndarray
    ids: np.ndarray = dataclasses.field(repr=False)
    batches: tuple[lt.PromptBatch, ...] = dataclasses.field(repr=False)
    pad_id: int = 0
    eval_tokens: int = 16384

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """The distinct batch shapes (one compilation each)."""
        return tuple(sorted({b.ids.shape for b in self.batches}))

    def only(self, task: int | str) -> NLISet:
        """The pairs of one task as a set of its own (its rows keep their ``head``)."""
        i = self.task_index(task)
        r = self.rows(i)
        return _assemble(
            (self.task_names[i],), (self.heads[i],), self.ids[r], self.lengths[r],
            np.zeros(len(r), np.int32), self.head[r], self.labels[r],
            pad_id=self.pad_id, eval_tokens=self.eval_tokens,
        )  # fmt: skip

    def fingerprint(self) -> str:
        """sha256 of the pairs' tokens, tasks, heads, labels and masks."""
        h = hashlib.sha256()
        for x in (self.ids, self.lengths, self.task, self.head, self.labels):
            h.update(np.ascontiguousarray(x).tobytes())
        h.update(json.dumps([self.task_names, [list(x.used) for x in self.heads]]).encode())
        return h.hexdigest()


def _assemble(names, heads, ids, lengths, task, head, labels, *, pad_id, eval_tokens) -> NLISet:
    lengths = np.asarray(lengths, np.int32)
    order = np.argsort(-lengths, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat = np.concatenate([ids[i, :n] for i, n in enumerate(lengths)] or [np.zeros(0, np.int32)])
    enc = Encoded(flat.astype(np.int32), offsets)
    return NLISet(
        task_names=tuple(names),
        heads=tuple(heads),
        task=np.asarray(task, np.int32),
        head=np.asarray(head, np.int32),
        labels=np.asarray(labels, np.int32),
        lengths=lengths,
        ids=np.asarray(ids, np.int32),
        batches=tuple(_eval_batches(enc, order, eval_tokens=eval_tokens, pad_id=pad_id)),
        pad_id=pad_id,
        eval_tokens=eval_tokens,
    )


def make_set(
    tokenizer: Any,
    heads: Sequence[HeadSpec],
    splits: Sequence[Any],
    *,
    max_len: int,
    eval_tokens: int = 16384,
) -> NLISet:
    """Tokenize (:func:`encode_pairs`) and batch the splits of several tasks, one head each.

    Raises:
      InputError: a count mismatch, no pairs at all, a label of a class the task's head masks.
    """
    if len(heads) != len(splits):
        raise InputError(
            f"nli_head.make_set: {len(heads)} heads for {len(splits)} splits; pass one per task."
        )
    encs, task, labels = [], [], []
    c = num_classes(heads) if heads else NUM_CLASSES
    for i, (h, sp) in enumerate(zip(heads, splits, strict=True)):
        lab = np.asarray(sp.labels, np.int64)
        bad = lab[(lab < 0) | (lab >= c)]
        if bad.size or not np.asarray(h.used)[lab].all():
            v = int(bad[0]) if bad.size else int(lab[~np.asarray(h.used)[lab]][0])
            raise InputError(
                f"nli_head.make_set: task {h.task!r} has an example of class {v} but its head "
                f"uses the classes {[c for c, u in enumerate(h.used) if u]} ({h.names})."
            )
        encs.append(encode_pairs(tokenizer, list(sp.texts), max_len=max_len))
        task += [i] * len(sp.labels)
        labels += lab.tolist()
    lengths = np.concatenate([e.lengths for e in encs])
    if not len(lengths):
        raise InputError("nli_head.make_set: the splits hold no pairs.")
    pad = lt.pad_id(tokenizer)
    ids = np.full((len(lengths), int(lengths.max())), pad, np.int32)
    r = 0
    for e in encs:
        for i in range(len(e)):
            x = e.row(i)
            ids[r, : len(x)] = x
            r += 1
    return _assemble(
        [h.task for h in heads], heads, ids, lengths, task, task, labels, pad_id=pad,
        eval_tokens=eval_tokens,
    )  # fmt: skip


# ------------------------------------------------------------------------------------ scorer


class Scorer(PassCounter):
    """The frozen base decoder with a classification head per task; merges folded into the
    kernels (``lang_eval.Scorer``'s fold), pairs pooled at their last token, each row read by its
    own task's head.

    Args:
      model: a :class:`llama.Llama` without adapters.

    Attributes:
      model, module_names: the model and the adapter module names it takes.
      passes, tokens, slot_tokens, seconds: work done so far.
    """

    def __init__(self, model: llama.Llama):
        self.folder = le.Scorer(model)
        self.model = model
        self.module_names = self.folder.module_names
        graphdef = self.folder.graphdef

        def pool(kernels, rest, ids, mask):
            m = nnx.merge(graphdef, kernels, rest)
            return pool_last(m.hidden_states(ids, mask), mask)

        self._pool = jax.jit(pool)
        self._classify = jax.jit(class_logits)

    def deltas(self, adapter: Mapping[str, Any] | None) -> Any:
        """The dense updates of ``adapter`` shaped like the adapted kernels
        (``lang_eval.Scorer.deltas``)."""
        return self.folder.deltas(adapter)

    def logits(
        self,
        ds: NLISet,
        scores: Any,
        used: Any,
        adapter: Mapping[str, Any] | None = None,
        coef: float = 1.0,
        *,
        deltas: Any = None,
    ) -> np.ndarray:
        """``(N, C)`` float32 masked logits of every pair of ``ds`` under the base model plus
        ``coef * adapter`` (or ``coef * deltas``), each read by its head.

        Args:
          ds: the pairs.
          scores: ``(T, D, C)`` the stacked heads (``ds.head`` indexes them).
          used: ``(T, C)`` bool, the classes each head uses.
          adapter, coef, deltas: the update folded into the kernels (None: the base model).
        """
        t0 = time.perf_counter()
        if deltas is None and adapter is None:
            kernels = self.folder.kernels
        else:
            kernels = self.folder.fold(self.deltas(adapter) if deltas is None else deltas, coef)
        scores = jnp.asarray(scores, jnp.float32)
        used = jnp.asarray(used, bool)
        pending = []
        for b in ds.batches:
            pooled = self._pool(kernels, self.folder.rest, b.ids, b.mask)
            head = jnp.asarray(np.where(b.index >= 0, ds.head[np.maximum(b.index, 0)], 0))
            pending.append((b.index, self._classify(pooled, scores, head, used)))
        return self.gather(pending, (len(ds), int(scores.shape[-1])), ds, t0)

    def correct(
        self, ds: NLISet, scores, used, adapter=None, coef: float = 1.0, **kw
    ) -> np.ndarray:
        """``(N,)`` bool: each pair classified right (argmax of its masked logits)."""
        return np.argmax(self.logits(ds, scores, used, adapter, coef, **kw), axis=1) == ds.labels


def _log_probs(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=1, keepdims=True)
    lp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return lp[np.arange(len(labels)), labels]


# --------------------------------------------------------------------------------- evaluator


class Evaluator(ev.MergeSearch):
    """Single-LoRA, zero-shot (trained heads, no LoRA) and merged accuracies on val and test,
    with the interface of ``encoder_eval.Evaluator`` (the coefficient search is
    ``evaluate.MergeSearch``); each task is always read by its own trained head.

    Args:
      scorer: a :class:`Scorer`.
      adapters: one LoRA adapter per task, in ``val.task_names`` order.
      scores: one head ``(D, C)`` per task, same order.
      val, test: :class:`NLISet` of the same tasks.
      cache_dir: where single and zero-shot correctness are cached (None: not cached).
      adapter_keys: one training cache key per task (needed to cache).
      weights: the model's fingerprint (default computed when caching).
    """

    def __init__(
        self,
        scorer: Scorer,
        adapters: Sequence[Mapping[str, Any]],
        scores: Sequence[Any],
        val: NLISet,
        test: NLISet,
        *,
        cache_dir: str | os.PathLike | None = None,
        adapter_keys: Sequence[str] | None = None,
        weights: str | None = None,
    ):
        if val.task_names != test.task_names:
            raise InputError(
                f"nli_head.Evaluator: validation tasks {val.task_names} differ from test tasks "
                f"{test.task_names}."
            )
        n = len(val.task_names)
        if not len(adapters) == len(scores) == n:
            raise InputError(
                f"nli_head.Evaluator: {len(adapters)} adapters and {len(scores)} heads for {n} "
                "tasks; pass one of each per task, in the sets' task order."
            )
        if adapter_keys is not None and len(adapter_keys) != n:
            raise InputError(f"nli_head.Evaluator: {len(adapter_keys)} adapter keys for {n} tasks.")
        c = num_classes(val.heads)
        shapes = sorted({np.shape(s) for s in scores})
        if shapes != [(scorer.model.config.hidden_size, c)]:
            raise InputError(
                f"nli_head.Evaluator: heads of shape {', '.join(map(str, shapes))}; expected "
                f"({scorer.model.config.hidden_size}, {c}) (hidden size x classes)."
            )
        stacked = np.stack([np.asarray(s, np.float32) for s in scores])
        self.scorer, self.adapters = scorer, list(adapters)
        self.scores = jnp.asarray(stacked)
        self.used = jnp.asarray(used_mask(val.heads))
        self.val, self.test, self.task_names = val, test, val.task_names
        if cache_dir is not None and weights is None:
            weights = le.model_fingerprint(scorer.model)
        self._cache, self._keys, self._weights = cache_dir, adapter_keys, weights
        self.single_val_correct = self._per_task(val, "single")
        self.single_test_correct = self._per_task(test, "single")
        self.single_val = ev.accuracies(self.single_val_correct, val)
        self.single_test = ev.accuracies(self.single_test_correct, test)
        zs_val = self._per_task(val, "zero_shot_head")
        self.zero_shot_test_correct = self._per_task(test, "zero_shot_head")
        self.zero_shot_val = ev.accuracies(zs_val, val)
        self.zero_shot_test = ev.accuracies(self.zero_shot_test_correct, test)

    def _per_task(self, ds: NLISet, kind: str) -> np.ndarray:
        ok = np.zeros(len(ds), bool)
        for i in range(len(self.task_names)):
            sub = ds.only(i)
            adapter = self.adapters[i] if kind == "single" else None

            def compute(sub=sub, adapter=adapter) -> np.ndarray:
                return self.scorer.correct(sub, self.scores, self.used, adapter)

            if self._keys is None or self._cache is None:
                ok[ds.rows(i)] = compute()
                continue
            what = {
                "kind": kind,
                "suite": "nli",
                "nli_code_version": CODE_VERSION,
                "adapter": self._keys[i],
                "weights": self._weights,
                "pairs": sub.fingerprint(),
            }
            ok[ds.rows(i)] = le.cached_correct(self._cache, what, compute)[0]
        return ok

    def correct(self, ds: NLISet, adapter=None, coef: float = 1.0, *, deltas=None) -> np.ndarray:
        """``(N,)`` bool correctness on ``ds`` of the base model plus ``coef * adapter``."""
        return self.scorer.correct(ds, self.scores, self.used, adapter, coef, deltas=deltas)

    def deltas(self, adapter: Mapping[str, Any]) -> Any:
        """The merge's updates as the scorer folds them."""
        return self.scorer.deltas(adapter)


# ----------------------------------------------------------------------------------- training


class HeadedTask(NamedTuple):
    """A trained task: its LoRA adapter, its head and what happened (``fitting.TrainedTask``
    with ``score``; the runner reads ``name``, ``adapter`` and ``info``).

    Attributes:
      name, labels, adapter, info: as ``fitting.TrainedTask`` (adapter module names
        ``model/layers/{i}/self_attn/{q,k,v,o}_proj``).
      score: ``(D, C)`` float32, the trained head (``score.weight`` transposed).
    """

    name: str
    labels: tuple[str, ...]
    adapter: dict[str, dict[str, Any]]
    info: dict[str, Any]
    score: np.ndarray


_SCORE_INFO = "score_head"  # the head rides in the cached TrainedTask's info under this key


def _headed(t: ft.TrainedTask) -> HeadedTask:
    info = dict(t.info)
    score = np.asarray(info.pop(_SCORE_INFO), np.float32)
    return HeadedTask(t.name, tuple(t.labels), t.adapter, info, score)


class Trainer(LoraTrainer):
    """Trains task LoRAs and heads on one shared base decoder (see the module docstring; the NLI
    suite's part of :class:`trainer.LoraTrainer`: its loss with dropout and clipping, a state
    of LoRA and head, its batches); the jitted step compiles once per length bucket and
    schedule.

    Args:
      config: hyperparameters (:class:`NLITrainConfig`).
      model: the base :class:`llama.Llama` (no adapters).
      tokenizer: its tokenizer.
      scorer: a :class:`Scorer` of ``model`` for validation (default made here).
      num_classes: the classes of the label space the heads read (:data:`NUM_CLASSES`, the NLI
        suite's three, by default).
      place: puts a fresh LoRA-and-head state and its optimizer state on the devices
        (``trainer.LoraTrainer``'s ``place``: e.g. ``sharding.shard_state`` on the model's mesh);
        None: replicated over the base model's mesh when it is split, else left as it is.
    """

    where = "nli_head.Trainer"
    report_slots = True

    def __init__(
        self,
        config: NLITrainConfig,
        model: llama.Llama,
        tokenizer: Any,
        *,
        scorer: Scorer | None = None,
        num_classes: int = NUM_CLASSES,
        place: Callable[[Any], Any] | None = None,
    ):
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise InputError(
                f"nli_head.Trainer: num_classes={num_classes!r}; expected an integer >= 2."
            )
        self.num_classes = num_classes
        if not isinstance(config, NLITrainConfig):
            raise InputTypeError(
                f"nli_head.Trainer: config is a {type(config).__name__}; expected NLITrainConfig."
            )
        if model.lora is not None:
            raise InputError(
                "nli_head.Trainer: the model has LoRA adapters; pass the base model, the trainer "
                "adds fresh ones per task."
            )
        self.model, self.tokenizer = model, tokenizer
        self.scorer = Scorer(model) if scorer is None else scorer
        self.lora = llama.LoRAConfig(config.lora_rank, config.lora_alpha)
        lmodel = with_lora_dropout(
            llama.add_lora(model, self.lora, rngs=nnx.Rngs(0)), config.lora_dropout
        )
        self.graphdef, _, self._keys, base_state = nnx.split(lmodel, nnx.LoRAParam, DropoutKey, ...)
        graphdef = self.graphdef
        flat_keys = list(nnx.to_flat_state(self._keys))
        max_norm = float(config.max_grad_norm)

        def fresh_keys(key):
            ks = jax.random.split(key, max(len(flat_keys), 1))
            return nnx.from_flat_state(
                [(p, v.replace(ks[i])) for i, (p, v) in enumerate(flat_keys)]
            )

        def loss_fn(params, base, key, ids, mask, labels, valid, used):
            if max_norm > 0:
                params = clip_gradient(params, max_norm)
            m = nnx.merge(graphdef, params["lora"], fresh_keys(key), base)
            pooled = pool_last(m.hidden_states(ids, mask), mask)
            head = jnp.zeros(ids.shape[0], jnp.int32)
            z = class_logits(pooled, params["score"][None], head, used[None])
            return masked_loss(z, labels, valid)

        super().__init__(config, loss_fn, base_state, place=place)
        self._loss = jax.jit(loss_fn)

    def init(self, name: str) -> dict[str, Any]:
        """Fresh parameters of task ``name``: LoRA ``A`` from ``fitting.init_seed``, ``B = 0``, and
        a head drawn as transformers initialises ``score`` (normal, std 0.02, from the same
        seed)."""
        seed = ft.init_seed(self.config, name)
        lora = lora_state(llama.add_lora(self.model, self.lora, rngs=nnx.Rngs(seed)))
        rng = np.random.default_rng([seed, 2])
        score = rng.normal(0.0, _SCORE_STD, (self.model.config.hidden_size, self.num_classes))
        return {"lora": lora, "score": jnp.asarray(score, jnp.float32)}

    def adapter(self, lora: Any) -> dict[str, dict[str, Any]]:
        """The adapter (float32 numpy modules, ``nu.nnx.extract_adapter`` names) of a LoRA
        state."""
        return ltr.lora_adapter(nnx.merge(self.graphdef, lora, self._keys, self.base_state))

    def step_key(self, name: str, step: int) -> jax.Array:
        """The dropout key of step ``step`` of task ``name`` (a stream of ``fitting.task_seed``)."""
        return jnp.asarray(ft.task_seed(self.config, name, 3, step).generate_state(2, np.uint32))

    def loss(self, params, head: HeadSpec, ids, mask, labels, valid, *, key=None) -> float:
        """The training loss of a batch (no update; dropout drawn from ``key``, default step 0's
        key of the head's task)."""
        key = self.step_key(head.task, 0) if key is None else key
        used = jnp.asarray(head.used)
        return float(self._loss(params, self.base_state, key, ids, mask, labels, valid, used))

    def task_config(self, task: Any) -> NLITrainConfig:
        """The task's config (``fitting.task_config``) with the schedule's length for its
        training pairs (:meth:`NLITrainConfig.steps_for`)."""
        cfg = ft.task_config(self.config, task.name)
        return dataclasses.replace(cfg, max_steps=cfg.steps_for(len(task.train)))

    def prepare(
        self, task: Any, head: HeadSpec, cfg: NLITrainConfig, val: NLISet | None
    ) -> TaskRun:
        """Task ``task`` with its ``head``: batches of ``rows`` pairs
        (``lang_train.epoch_batches``), a fresh dropout key a step, validation on ``val``
        (default made from ``task.val``).

        Raises:
          InputError: a training example of a class the head masks.
        """
        labels = np.asarray(task.train.labels, np.int32)
        if len(head.used) != self.num_classes:
            raise InputError(
                f"nli_head.Trainer.fit: task {task.name!r}'s head reads {len(head.used)} classes; "
                f"the trainer's heads have {self.num_classes} (Trainer(num_classes=...))."
            )
        if not np.asarray(head.used)[labels].all():
            raise InputError(
                f"nli_head.Trainer.fit: task {task.name!r} has training examples of a class its "
                f"head masks ({head.names})."
            )
        enc = encode_pairs(self.tokenizer, list(task.train.texts), max_len=cfg.row_len)
        if val is None:
            val = make_set(
                self.tokenizer, [head], [task.val], max_len=cfg.row_len,
                eval_tokens=cfg.eval_tokens,
            )  # fmt: skip
        used = jnp.asarray(head.used)
        lengths, pad = enc.lengths, lt.pad_id(self.tokenizer)

        def epoch(seed: np.random.SeedSequence) -> list[np.ndarray]:
            return ltr.epoch_batches(lengths, rows=cfg.rows, seed=seed)

        def batch(chosen: np.ndarray, done: int) -> Batch:
            ids, mask, lab, valid = train_batch(enc, labels, chosen, rows=cfg.rows, pad_id=pad)
            args = (self.step_key(task.name, done), ids, mask, lab, valid, used)
            return Batch(args, int(lengths[chosen].sum()), ids.shape, ids.size)

        def validate(params) -> tuple[float, float]:
            score = np.asarray(params["score"], np.float32)[None]
            z = self.scorer.logits(val, score, used[None], self.adapter(params["lora"]))
            acc = float((np.argmax(z, axis=1) == val.labels).mean())
            return acc, float(-_log_probs(z, val.labels).mean())

        return TaskRun(epoch, batch, validate)

    def trained(self, task: Any, best: Any, info: dict[str, Any]) -> ft.TrainedTask:
        """The trained task, its head in ``info`` under ``"score_head"`` (:func:`train_task`
        turns it into a :class:`HeadedTask`)."""
        info = {**info, _SCORE_INFO: np.asarray(best["score"], np.float32)}
        return ft.TrainedTask(task.name, tuple(task.labels), self.adapter(best["lora"]), info)


# ------------------------------------------------------------------------------------ caching


def _pairs_fingerprint(tokenizer: Any, task: Any, config: NLITrainConfig) -> str:
    h = hashlib.sha256()
    for split in (task.train, task.val):
        enc = encode_pairs(tokenizer, list(split.texts), max_len=config.row_len)
        h.update(np.ascontiguousarray(enc.flat).tobytes())
        h.update(np.ascontiguousarray(enc.offsets).tobytes())
    return h.hexdigest()


def cache_key(
    task: Any,
    head: HeadSpec,
    config: NLITrainConfig,
    *,
    tokenizer: Any,
    weights: str,
    dtype: str,
    suite: str = "nli",
) -> tuple[str, dict[str, Any]]:
    """``(hex key, the document hashed)`` naming the result of training ``task``: the suite, the
    task's data, its tokenized train and validation pairs, its head, the config (with its seed),
    the model's weights and compute dtype, and :data:`CODE_VERSION`."""
    what = {
        "code_version": CODE_VERSION,
        "suite": suite,
        "task": ft.task_fingerprint(task),
        "pairs": _pairs_fingerprint(tokenizer, task, config),
        "head": {"used": list(head.used), "names": list(head.names)},
        "config": ft.config_key_doc(config),
        "weights": weights,
        "dtype": dtype,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest(), what


def load_cached(path: pathlib.Path) -> HeadedTask | None:
    """The trained task stored at ``path`` (``fitting.cache_path``), or None."""
    t = ft.load_cached(pathlib.Path(path))
    if t is None or _SCORE_INFO not in t.info:
        return None
    return _headed(t)


def train_task(
    task: Any,
    head: HeadSpec,
    config: NLITrainConfig,
    *,
    tokenizer: Any,
    weights: str,
    dtype: str,
    cache_dir: str | os.PathLike,
    trainer: Trainer | Callable[[], Trainer] | None = None,
    progress: Callable[[int, dict], None] | None = None,
    suite: str = "nli",
) -> HeadedTask:
    """Train ``task`` with ``config`` (as ``fitting.task_config`` gives it), or load it from
    ``cache_dir/<task>-<key>`` (``suite`` names the suite in the key).

    Returns:
      :class:`HeadedTask`; ``info["cache_hit"]`` says whether it came from the cache.
    """
    own = ft.task_config(config, task.name)
    key, what = cache_key(
        task, head, own, tokenizer=tokenizer, weights=weights, dtype=dtype, suite=suite
    )
    doc = {**what, "task_name": task.name, "key": key}
    got = train_cached(
        task, head, config, kind=Trainer, trainer=trainer, cache_dir=cache_dir, key=key,
        key_doc=doc, where="nli_head.train_task", progress=progress,
    )  # fmt: skip
    if _SCORE_INFO not in got.info:
        raise InputError(
            f"nli_head.train_task: the cache entry {ft.cache_path(cache_dir, task, key)} holds "
            "no head; delete it to retrain."
        )
    return _headed(got)


def train_tasks(
    tasks: Sequence[Any],
    heads: Sequence[HeadSpec],
    config: NLITrainConfig,
    *,
    model: llama.Llama,
    tokenizer: Any,
    weights: str,
    cache_dir: str | os.PathLike,
    scorer: Scorer | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    suite: str = "nli",
    place: Callable[[Any], Any] | None = None,
) -> list[HeadedTask]:
    """Train (or load) every task, a tqdm bar each; one :class:`Trainer` (its heads as wide as
    ``heads``' label space, its states put on the devices by ``place``) made on the first cache
    miss and shared; ``log`` gets a line per task; ``suite`` names the suite in the cache
    keys."""
    c = num_classes(heads) if heads else NUM_CLASSES
    trainer = functools.cache(
        lambda: Trainer(config, model, tokenizer, scorer=scorer, num_classes=c, place=place)
    )
    dtype = np.dtype(model.dtype).name

    def one(task: Any, head: HeadSpec, tick: Callable[[int, dict], None]) -> HeadedTask:
        return train_task(
            task, head, config, tokenizer=tokenizer, weights=weights, dtype=dtype,
            cache_dir=cache_dir, trainer=trainer, progress=tick, suite=suite,
        )  # fmt: skip

    def total(task: Any) -> int:
        return ft.task_config(config, task.name).steps_for(len(task.train))

    return ft.train_each(tasks, heads, config, one, progress=progress, log=log, total=total)


# ------------------------------------------------------------------------------------- export

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
