"""The NLI head formulation's model side (:mod:`nli_head`): the heads and LoRA dropout.

A premise-hypothesis pair is read by a linear ``score`` head without bias, ``D x C``, over the
decoder's final-normed hidden state at the pair's **last real token** (:func:`pool_last`), as
transformers' ``Qwen3ForSequenceClassification`` / ``LlamaForSequenceClassification`` pool it.
Each task has its head (:class:`HeadSpec`: the classes of the shared label space it uses); a
class a task does not use (a binary task's: QNLI and RTE class 1, SciTail class 2) has its logit
set to :data:`MASK_LOGIT` before the loss and at evaluation (:func:`class_logits`), so it is
never predicted and takes no gradient. :func:`clip_gradient` clips the gradient as transformers'
``Trainer`` does, and :class:`DropoutLoRALinear` is PEFT's ``lora_dropout`` on the LoRA branch's
input (:func:`with_lora_dropout` puts it on a model's LoRA layers).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ...errors import InputError
from ..data import nli_data as nd
from ..models import llama
from ..models.llama_model import variable_at
from ..models.minilm_model import LoRALinear

__all__ = [
    "CODE_VERSION",
    "MASK_LOGIT",
    "NUM_CLASSES",
    "DropoutKey",
    "DropoutLoRALinear",
    "HeadSpec",
    "class_logits",
    "clip_gradient",
    "head_spec",
    "masked_loss",
    "num_classes",
    "pool_last",
    "used_mask",
    "with_lora_dropout",
]

#: Bump when a change to the head formulation (its modules, ``nli_head_*``) changes what training
#: or evaluation produces: invalidates the caches.
CODE_VERSION = 1
#: Classes of the NLI suite's unified label space (:data:`nli_data.LABELS`); a head of another
#: suite may have any number (its :class:`HeadSpec`'s ``used`` gives it: :func:`num_classes`).
NUM_CLASSES = len(nd.LABELS)
#: The logit of a task's unused class (Appendix B: "setting its logit to -10^10").
MASK_LOGIT = -1e10


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
