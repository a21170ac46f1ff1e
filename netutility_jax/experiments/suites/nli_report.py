"""The NLI suite's report wording (``report.SuiteReport``): the decoder, its pair
classification and the label mapping. Imported when a report is made (:mod:`nli` stays cheap to
import)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..harness.report_markdown import SuiteReport

__all__ = ["NLIReport"]


class NLIReport(SuiteReport):
    """The report's wording and fields for the NLI suite (``report.SuiteReport`` is the
    encoder's): the decoder, its pair classification and the label mapping.

    Args:
      description: the model (:attr:`nli.NLISuite.description`).
      run: the run (its tasks' label mappings are described).
      placement: where the model lies (``sharding.placement_record``), recorded as
        ``results["placement"]``; None: not recorded.
    """

    unit = "pairs"
    layers = "every layer"
    zero_shot_model = "base model with each task's trained head"

    def __init__(self, description: str, run: Any, placement: dict[str, Any] | None = None):
        self.description = description
        self.placement = placement
        self.mapping = "; ".join(
            f"{t.name}: " + ", ".join(
                f"{lab} <- {txt}" for lab, txt in zip(t.labels, t.label_texts, strict=True)
            )
            for t in run.tasks
        )  # fmt: skip

    def evaluation(self, run: Any, common: dict[str, Any]) -> dict[str, Any]:
        from . import nli_head as nh

        tc = run.preset.train
        return {
            **common,
            "model": self.description,
            "max_pair_tokens": tc.row_len,
            "eval_tokens": tc.eval_tokens,
            "formulation": "sequence classification: last-token pooling of the final hidden "
            "state, linear head (no bias) over entailment/neutral/contradiction per task",
            "mask_logit": nh.MASK_LOGIT,
        }

    def fields(self, run: Any) -> dict[str, Any]:
        return {} if self.placement is None else {"placement": self.placement}

    def title(self, results: Mapping[str, Any]) -> str:
        return f"# netutility demo --suite nli ({results['preset']})"

    def model(self, results: Mapping[str, Any]) -> str:
        tc = results["train_config"]
        return (
            f"NLI suite: {self.description}; each task is a premise-hypothesis pair of at "
            f"most {tc['row_len']} tokens classified by its own linear head over the last "
            "token's final hidden state (entailment, neutral, contradiction; a binary task's "
            "unused class masked at -1e10), trained with the task's LoRA (dropout "
            f"{tc['lora_dropout']:g}); every merged model is read by each task's own head"
        )

    def heads(self, results: Mapping[str, Any]) -> str:
        return (
            f"Heads: trained per task with its LoRA. Label mapping (class <- the dataset's "
            f"label): {self.mapping}."
        )

    def step(self, train_config: Mapping[str, Any]) -> str:
        return (
            f"a step has {train_config['rows']} pair(s) of at most {train_config['row_len']} "
            "tokens"
        )
