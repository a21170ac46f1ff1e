"""CLIP's configs (the two towers, the joint model, LoRA adapters), checked as transformers does.

:class:`CLIPConfig` (with :class:`CLIPVisionConfig` and :class:`CLIPTextConfig`, whose defaults are
ViT-B/32's) is transformers' ``CLIPConfig``, read from a Hugging Face ``config.json`` by
:meth:`CLIPConfig.from_hf`; :class:`LoRAConfig` says which linear layers of which towers get LoRA
adapters. :mod:`~netutility_jax.experiments.models.clip_model` builds the network from them and
:mod:`netutility_jax.experiments.models.clip` re-exports every public name here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from ...errors import InputError, InputTypeError

__all__ = [
    "ACTIVATIONS",
    "ALL_TARGETS",
    "LORA_TARGETS",
    "TOWERS",
    "CLIPConfig",
    "CLIPTextConfig",
    "CLIPVisionConfig",
    "LoRAConfig",
]


def _quick_gelu(x: jax.Array) -> jax.Array:
    return x * jax.nn.sigmoid(1.702 * x)


ACTIVATIONS: Mapping[str, Callable[[jax.Array], jax.Array]] = {
    "quick_gelu": _quick_gelu,  # OpenAI CLIP: x * sigmoid(1.702 x)
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}
"""The ``hidden_act`` values this port runs, as transformers' ``ACT2FN`` defines them."""

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
ALL_TARGETS = (*LORA_TARGETS, "fc1", "fc2")
TOWERS = ("vision", "text")


# ------------------------------------------------------------------------------------- configs


def _positive_int(fn: str, name: str, v: Any) -> int:
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
        raise InputError(f"{fn}: {name}={v!r}; expected a positive int.")
    return int(v)


_INTS = {
    "vision": (
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_channels",
        "image_size",
        "patch_size",
    ),
    "text": (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "max_position_embeddings",
    ),
}


def _check_tower(fn: str, kind: str, v: Mapping[str, Any], label: Callable[[str], str]) -> None:
    """Validate the fields ``v`` of a tower config; ``label`` spells a field in messages."""
    for name in _INTS[kind]:
        _positive_int(fn, label(name), v[name])
    if v["hidden_size"] % v["num_heads"]:
        raise InputError(
            f"{fn}: {label('hidden_size')} {v['hidden_size']} is not divisible by "
            f"{label('num_heads')} {v['num_heads']}; each head needs hidden_size / num_heads "
            "features."
        )
    act = v["hidden_act"]
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise InputError(
            f"{fn}: {label('hidden_act')}={act!r}; this port implements {sorted(ACTIVATIONS)}."
        )
    eps = v["layer_norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 < eps < 1):
        raise InputError(f"{fn}: {label('layer_norm_eps')}={eps!r}; expected a number in (0, 1).")
    if kind == "vision" and v["patch_size"] > v["image_size"]:
        raise InputError(
            f"{fn}: {label('patch_size')} {v['patch_size']} exceeds {label('image_size')} "
            f"{v['image_size']}; the image holds no patch."
        )
    if kind == "text":
        e = v["eos_token_id"]
        if not isinstance(e, (int, np.integer)) or isinstance(e, bool) or e < 0:
            raise InputError(
                f"{fn}: {label('eos_token_id')}={e!r}; expected one non-negative int (the "
                "end-of-text id the text embedding is read at)."
            )


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig:
    """The vision tower (a pre-LN ViT with a class token; transformers' ``CLIPVisionConfig``).

    Attributes:
      hidden_size: ``D_v``.
      intermediate_size: ``F_v``, the MLP width.
      num_layers: ``num_hidden_layers``.
      num_heads: ``num_attention_heads``; ``D_v % num_heads == 0``.
      num_channels: ``C`` of the pixel values.
      image_size: ``S``: inputs are ``(B, C, S, S)``.
      patch_size: ``p``: ``(S // p)^2`` patches plus the class token.
      hidden_act: the MLP activation, a key of :data:`ACTIVATIONS`.
      layer_norm_eps: epsilon of every LayerNorm.

    The defaults are ViT-B/32's (openai/clip-vit-base-patch32).
    """

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_layers: int = 12
    num_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5

    def __post_init__(self):
        _check_tower("CLIPVisionConfig", "vision", dataclasses.asdict(self), str)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_positions(self) -> int:
        """Patches plus the class token: ``(S // p)^2 + 1``."""
        return (self.image_size // self.patch_size) ** 2 + 1


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig:
    """The text tower (a causal pre-LN transformer; transformers' ``CLIPTextConfig``).

    Attributes:
      vocab_size: ``V``.
      hidden_size: ``D_t``.
      intermediate_size: ``F_t``.
      num_layers: ``num_hidden_layers``.
      num_heads: ``num_attention_heads``.
      max_position_embeddings: ``T_max``: the longest input.
      hidden_act: the MLP activation, a key of :data:`ACTIVATIONS`.
      layer_norm_eps: epsilon of every LayerNorm.
      eos_token_id: the end-of-text id the pooled state is read at. transformers' rule: when it
        is 2 (configs written before transformers PR #24773, openai/clip-vit-base-patch32's
        among them) the pooled position is the argmax of the ids (the end-of-text token has the
        largest id of the original vocabulary); otherwise the first position holding
        ``eos_token_id``.

    The defaults are ViT-B/32's text tower.
    """

    vocab_size: int = 49408
    hidden_size: int = 512
    intermediate_size: int = 2048
    num_layers: int = 12
    num_heads: int = 8
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    eos_token_id: int = 49407

    def __post_init__(self):
        _check_tower("CLIPTextConfig", "text", dataclasses.asdict(self), str)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def legacy_eos(self) -> bool:
        """Pool at ``argmax(input_ids)`` (``eos_token_id == 2``, transformers' legacy rule)."""
        return self.eos_token_id == 2


_VISION_FIELDS = {
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_channels": "num_channels",
    "image_size": "image_size",
    "patch_size": "patch_size",
    "hidden_act": "hidden_act",
    "layer_norm_eps": "layer_norm_eps",
}
_TEXT_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "max_position_embeddings": "max_position_embeddings",
    "hidden_act": "hidden_act",
    "layer_norm_eps": "layer_norm_eps",
    "eos_token_id": "eos_token_id",
}


@dataclasses.dataclass(frozen=True)
class CLIPConfig:
    """Both towers and the shared embedding space (transformers' ``CLIPConfig``).

    Attributes:
      vision_config: the vision tower.
      text_config: the text tower.
      projection_dim: ``P``, the width of the joint embedding (``visual_projection`` and
        ``text_projection``).
    """

    vision_config: CLIPVisionConfig = CLIPVisionConfig()
    text_config: CLIPTextConfig = CLIPTextConfig()
    projection_dim: int = 512

    def __post_init__(self):
        fn = "CLIPConfig"
        if not isinstance(self.vision_config, CLIPVisionConfig):
            raise InputTypeError(
                f"{fn}: vision_config is a {type(self.vision_config).__name__}; expected a "
                "clip.CLIPVisionConfig."
            )
        if not isinstance(self.text_config, CLIPTextConfig):
            raise InputTypeError(
                f"{fn}: text_config is a {type(self.text_config).__name__}; expected a "
                "clip.CLIPTextConfig."
            )
        _positive_int(fn, "projection_dim", self.projection_dim)

    @classmethod
    def from_hf(cls, c: Mapping[str, Any], *, source: str = "config.json") -> CLIPConfig:
        """The config of a Hugging Face ``CLIPModel`` ``config.json``.

        Fields a sub-config leaves out take transformers' defaults (ViT-B/32's), as
        ``CLIPConfig.from_pretrained`` does; a ``text_config_dict`` / ``vision_config_dict``
        (old configs) replaces ``text_config`` / ``vision_config``, as there.

        Args:
          c: the parsed ``config.json``.
          source: where it came from, for messages.

        Raises:
          InputError: another ``model_type`` or architecture; a sub-config that is not a dict;
            a field of the wrong type or value (named, e.g. ``vision_config.patch_size``); an
            ``eos_token_id`` list; an activation this port does not implement.
        """
        fn = f"CLIPConfig.from_hf({source})"
        if not isinstance(c, Mapping):
            raise InputError(f"{fn}: the config is a {type(c).__name__}; expected a JSON object.")
        mt = c.get("model_type")
        archs = c.get("architectures") or []
        if mt != "clip" or not isinstance(archs, list) or (archs and "CLIPModel" not in archs):
            raise InputError(
                f"{fn}: model_type {mt!r} with architectures {archs!r}; this port loads "
                "transformers' CLIPModel checkpoints (model_type 'clip')."
            )
        vision = _sub_config(fn, c, "vision_config", CLIPVisionConfig, _VISION_FIELDS)
        text = _sub_config(fn, c, "text_config", CLIPTextConfig, _TEXT_FIELDS)
        proj = c.get("projection_dim", 512)
        _positive_int(fn, "projection_dim", proj)
        return cls(vision_config=vision, text_config=text, projection_dim=int(proj))


def _sub_config(
    fn: str, c: Mapping[str, Any], key: str, kind: type, fields: Mapping[str, str]
) -> Any:
    """One tower's config from ``c[key]`` (or the old ``c[key + "_dict"]``), transformers'
    defaults for the fields it leaves out."""
    sub = c.get(f"{key}_dict") or c.get(key) or {}
    if not isinstance(sub, Mapping):
        raise InputError(f"{fn}: {key} is a {type(sub).__name__}; expected a JSON object.")
    defaults = {f.name: f.default for f in dataclasses.fields(kind)}
    kw = {ours: defaults[ours] if sub.get(hf) is None else sub[hf] for ours, hf in fields.items()}
    _check_tower(
        fn, "vision" if kind is CLIPVisionConfig else "text", kw, lambda n: f"{key}.{fields[n]}"
    )
    return kind(**{k: int(v) if isinstance(v, np.integer) else v for k, v in kw.items()})


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters to put on CLIP (Hu et al., 2021; PEFT's ``LoraConfig`` analogue).

    Attributes:
      rank: ``r``.
      alpha: ``lora_alpha``; the update is scaled by ``alpha / r`` (default ``alpha = r``).
      targets: the linear layers adapted in every layer of the chosen towers, among
        :data:`ALL_TARGETS` (default the attention's ``q_proj, k_proj, v_proj, out_proj``).
      towers: ``"vision"`` and/or ``"text"`` (default the vision tower, as in KnOTS).
    """

    rank: int
    alpha: float | None = None
    targets: tuple[str, ...] = LORA_TARGETS
    towers: tuple[str, ...] = ("vision",)

    def __post_init__(self):
        fn = "clip.LoRAConfig"
        _positive_int(fn, "rank", self.rank)
        object.__setattr__(self, "targets", tuple(self.targets))
        object.__setattr__(self, "towers", tuple(self.towers))
        bad = [t for t in self.targets if t not in ALL_TARGETS]
        if bad or not self.targets:
            raise InputError(
                f"{fn}: targets {list(self.targets)} include unknown names {bad}; choose among "
                f"{ALL_TARGETS}."
            )
        bad = [t for t in self.towers if t not in TOWERS]
        if bad or not self.towers:
            raise InputError(
                f"{fn}: towers {list(self.towers)} include unknown names {bad}; choose among "
                f"{TOWERS}."
            )
        a = self.alpha
        if a is not None and (isinstance(a, bool) or not (np.isfinite(a) and a > 0)):
            raise InputError(f"{fn}: alpha={a!r}; expected a positive number.")

    @property
    def scale(self) -> float:
        """``alpha / r`` (1 when ``alpha`` is None)."""
        return 1.0 if self.alpha is None else float(self.alpha) / self.rank
