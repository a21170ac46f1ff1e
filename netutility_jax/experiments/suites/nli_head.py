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

**Modules.** This module gathers the formulation's public names from the modules that hold
them: :mod:`~netutility_jax.experiments.suites.nli_head_model` (the heads, the mask, gradient
clipping and LoRA dropout), :mod:`~netutility_jax.experiments.suites.nli_head_data` (pair
encoding and batching), :mod:`~netutility_jax.experiments.suites.nli_head_eval` (the scorer and
evaluator), :mod:`~netutility_jax.experiments.suites.nli_head_train` (the training config, the
trainer and its cache) and :mod:`~netutility_jax.experiments.suites.nli_head_export` (PEFT
folders); the NLI suite (:mod:`nli`) and the language suite's head form (:mod:`language_head`)
use it as ``nh``.

References:
  Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022. Qwen Team, "Qwen3
  Technical Report", 2025. Bowman et al. (SNLI) 2015; Williams et al. (MNLI) 2018; Marelli et al.
  (SICK) 2014; Wang et al. (GLUE: QNLI, RTE) 2019; Khot et al. (SciTail) 2018.
"""

from __future__ import annotations

from .nli_head_data import Encoded as Encoded
from .nli_head_data import NLISet as NLISet
from .nli_head_data import bucket_len as bucket_len
from .nli_head_data import encode_pairs as encode_pairs
from .nli_head_data import make_set as make_set
from .nli_head_data import train_batch as train_batch
from .nli_head_eval import Evaluator as Evaluator
from .nli_head_eval import Scorer as Scorer
from .nli_head_export import export_merged as export_merged
from .nli_head_export import export_peft as export_peft
from .nli_head_export import export_run as export_run
from .nli_head_export import load_peft as load_peft
from .nli_head_model import CODE_VERSION as CODE_VERSION
from .nli_head_model import MASK_LOGIT as MASK_LOGIT
from .nli_head_model import NUM_CLASSES as NUM_CLASSES
from .nli_head_model import DropoutKey as DropoutKey
from .nli_head_model import DropoutLoRALinear as DropoutLoRALinear
from .nli_head_model import HeadSpec as HeadSpec
from .nli_head_model import class_logits as class_logits
from .nli_head_model import clip_gradient as clip_gradient
from .nli_head_model import head_spec as head_spec
from .nli_head_model import masked_loss as masked_loss
from .nli_head_model import num_classes as num_classes
from .nli_head_model import pool_last as pool_last
from .nli_head_model import used_mask as used_mask
from .nli_head_model import with_lora_dropout as with_lora_dropout
from .nli_head_train import NO_STEP_CAP as NO_STEP_CAP
from .nli_head_train import HeadedTask as HeadedTask
from .nli_head_train import NLITrainConfig as NLITrainConfig
from .nli_head_train import Trainer as Trainer
from .nli_head_train import cache_key as cache_key
from .nli_head_train import load_cached as load_cached
from .nli_head_train import train_task as train_task
from .nli_head_train import train_tasks as train_tasks

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
    "num_classes",
    "pool_last",
    "train_batch",
    "train_task",
    "train_tasks",
    "used_mask",
    "with_lora_dropout",
]
