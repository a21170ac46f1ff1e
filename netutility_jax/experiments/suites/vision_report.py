"""The vision suite's report wording (``report.SuiteReport``): CLIP, its zero-shot heads, images,
and adapters that are given rather than trained."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..harness.report_markdown import SuiteReport

__all__ = ["VisionReport"]


class VisionReport(SuiteReport):
    """The report's wording and fields for the vision suite: CLIP, its zero-shot heads, images,
    and adapters that are given rather than trained."""

    unit = "images"
    zero_shot_model = "base CLIP with the zero-shot heads"
    trained = False

    def __init__(self, suite: Any, run: Any):
        from ..models import sharding

        self.description = suite.description
        self.layers = f"the {suite.config.vision_config.num_layers} layers of the vision tower"
        self.tasks = list(run.tasks)
        self.adapters = {n: str(p) for n, p in suite.adapter_dirs.items()}
        self.train = dataclasses.asdict(run.preset.train)
        self.placement = sharding.placement_record(
            getattr(suite, "placement", None), getattr(suite, "min_bytes", None)
        )

    def evaluation(self, run: Any, common: dict[str, Any]) -> dict[str, Any]:
        return {
            **common,
            "model": self.description,
            "batch_size": run.preset.train.batch_size,
            "heads": "CLIP zero-shot: exp(logit_scale) * unit(mean over templates of unit text "
            "embeddings) per class (KnOTS' heads)",
            "validation": {t.name: t.holdout for t in self.tasks},
        }

    def fields(self, run: Any) -> dict[str, Any]:
        own = {k: v for k, v in self.train.items() if k != "seed"}  # nothing trains here
        return {
            "train_config": {**own, "trained": False},
            "adapters": self.adapters,
            "placement": self.placement,
        }

    def title(self, results: Mapping[str, Any]) -> str:
        return f"# netutility demo --suite vision ({results['preset']})"

    def model(self, results: Mapping[str, Any]) -> str:
        return (
            f"Vision suite: {self.description}, each dataset classified by CLIP's zero-shot head "
            "from the base text tower (KnOTS' heads); the task LoRAs are given (PEFT folders), "
            "not trained"
        )

    def heads(self, results: Mapping[str, Any]) -> str:
        parts = [
            f"{t.name}: {len(t.templates)} template(s), e.g. {t.label_texts[0]!r}"
            for t in self.tasks
        ]
        return "Zero-shot heads (CLIP prompts per class): " + "; ".join(parts) + "."

    def step(self, train_config: Mapping[str, Any]) -> str:
        return "the adapters were loaded from PEFT folders, not trained here (no steps)"

    def training(self, results: Mapping[str, Any]) -> list[str]:
        """The adapters section (for a harness that asks a suite for its training section)."""
        lines = ["", "## Adapters (given, not trained)", "", "| Task | folder | r | alpha |",
                 "|---|---|---:|---:|"]  # fmt: skip
        first = next(iter(results["training"].values()))
        for name, i in first.items():
            lines.append(f"| {name} | {i['source']} | {i['r']} | {i['lora_alpha']:g} |")
        return lines
