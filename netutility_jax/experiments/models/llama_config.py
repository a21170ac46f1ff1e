"""The Llama-family decoder's settings: :class:`LlamaConfig` (shapes, RoPE) and :class:`LoRAConfig`.

:meth:`LlamaConfig.from_hf` reads a Hugging Face ``config.json`` (``LlamaForCausalLM`` or
``Qwen3ForCausalLM``; transformers 4's ``rope_scaling`` or 5's ``rope_parameters``) and refuses
what this port does not run. :mod:`netutility_jax.experiments.models.llama` re-exports every name here.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...errors import InputError

__all__ = [
    "ALL_TARGETS",
    "ARCHITECTURES",
    "LORA_TARGETS",
    "ROPE_TYPES",
    "LlamaConfig",
    "LoRAConfig",
]

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_TARGETS = (*LORA_TARGETS, "gate_proj", "up_proj", "down_proj")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shapes and settings of the decoder (the fields of a Hugging Face ``config.json``).

    Attributes:
      vocab_size: ``V``.
      hidden_size: ``D``.
      num_layers: ``num_hidden_layers``.
      num_heads: query heads ``H`` (``num_attention_heads``).
      num_kv_heads: key/value heads ``K`` (``num_key_value_heads``); ``H % K == 0``, each
        key/value head serves ``H / K`` consecutive query heads.
      head_dim: ``d`` per head (default ``D / H``; Qwen3 sets it).
      intermediate_size: ``F`` of the SwiGLU MLP.
      rms_norm_eps: epsilon of every RMSNorm.
      rope_theta: RoPE base.
      rope_type: ``"default"``, ``"linear"`` (frequencies / ``rope_factor``) or ``"llama3"``
        (Llama 3.1's smooth scaling with ``rope_factor``, ``rope_low_freq_factor``,
        ``rope_high_freq_factor``, ``rope_original_max_position``).
      max_position_embeddings: the context length the model was trained for (not enforced).
      tie_word_embeddings: the LM head is the embedding matrix.
      qk_norm: Qwen3's per-head RMSNorm on queries and keys before RoPE.
      attention_bias: biases on q, k, v, o (Llama's ``attention_bias``).
      mlp_bias: biases on the MLP projections.
      model_type: ``"llama"`` or ``"qwen3"`` (informational).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"

    def __post_init__(self):
        fn = "LlamaConfig"
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
        ):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise InputError(f"{fn}: {name}={v!r}; expected a positive int.")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise InputError(
                    f"{fn}: hidden_size {self.hidden_size} is not divisible by num_heads "
                    f"{self.num_heads}; set head_dim explicitly."
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim < 2 or self.head_dim % 2:
            raise InputError(f"{fn}: head_dim={self.head_dim}; RoPE needs an even head_dim >= 2.")
        if self.num_heads % self.num_kv_heads:
            raise InputError(
                f"{fn}: num_heads {self.num_heads} is not a multiple of num_kv_heads "
                f"{self.num_kv_heads}; grouped-query attention shares each key/value head "
                "between num_heads / num_kv_heads query heads."
            )
        if self.rope_type not in ROPE_TYPES:
            raise InputError(f"{fn}: rope_type={self.rope_type!r}; expected one of {ROPE_TYPES}.")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0 and self.rope_factor > 0):
            raise InputError(
                f"{fn}: rms_norm_eps={self.rms_norm_eps}, rope_theta={self.rope_theta} and "
                f"rope_factor={self.rope_factor} must be positive."
            )

    @classmethod
    def from_hf(cls, c: Mapping[str, Any], *, source: str = "config.json") -> LlamaConfig:
        """The config of a Hugging Face ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` ``config.json``.

        Reads ``rope_theta`` and ``rope_scaling`` (transformers 4) or ``rope_parameters``
        (transformers 5); missing ``num_key_value_heads`` means multi-head attention, missing
        ``head_dim`` means ``hidden_size / num_attention_heads`` (``null`` counts as missing).
        Every field is checked for its JSON type: integers are JSON integers (``16.0`` is read as
        16; ``16.9``, ``"16"`` and ``true`` are refused), booleans are JSON booleans (``"false"``
        is refused, never read by its truthiness), real numbers are finite.

        Args:
          c: the parsed ``config.json``.
          source: where it came from, for messages.

        Raises:
          InputError: not a JSON object; a field of the wrong type or out of range (named, with
            what is expected); another architecture or activation; a missing field; RoPE scaling
            other than linear/llama3; partial rotary; Qwen3 sliding-window attention.

        Example:
          >>> LlamaConfig.from_hf({"model_type": "llama", "vocab_size": 8, "hidden_size": 4.0,
          ...     "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
          ...     "tie_word_embeddings": "no"})
          Traceback (most recent call last):
          ...
          netutility_jax.errors.InputError: LlamaConfig.from_hf(config.json): tie_word_embeddings='no' (str); expected a JSON boolean (true or false).
        """
        fn = f"LlamaConfig.from_hf({source})"
        if not isinstance(c, Mapping):
            raise InputError(
                f"{fn}: the file holds a JSON {_json_kind(c)}; expected a JSON object (a Hugging "
                'Face config.json: {"model_type": "llama", "hidden_size": ...}).'
            )
        f = _Fields(fn, c)
        mt = c.get("model_type")
        if mt is not None and not isinstance(mt, str):
            f.fail("model_type", mt, f"one of {tuple(ARCHITECTURES)}")
        archs = c.get("architectures") or []
        if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
            f.fail("architectures", archs, 'a list of class names (["LlamaForCausalLM"])')
        if mt not in ARCHITECTURES or (archs and ARCHITECTURES[mt] not in archs):
            raise InputError(
                f"{fn}: model_type {mt!r} with architectures {archs}; this port runs "
                f"{sorted(ARCHITECTURES.values())} checkpoints (model_type 'llama' or 'qwen3')."
            )
        act = c.get("hidden_act", "silu")
        if not isinstance(act, str):
            f.fail("hidden_act", act, "'silu'")
        if act != "silu":
            raise InputError(f"{fn}: hidden_act={act!r}; this port implements SwiGLU ('silu').")
        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if c.get(k) is None
        ]
        if missing:
            raise InputError(f"{fn}: config.json lacks {missing}; it is not a complete config.")
        rope, rtype = _hf_rope(fn, c)
        if mt == "qwen3":
            layer_types = c.get("layer_types") or []
            if not (isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)):
                f.fail("layer_types", layer_types, 'a list of layer types (["full_attention"])')
            if f.boolean("use_sliding_window", False) or any(
                t != "full_attention" for t in layer_types
            ):
                raise InputError(
                    f"{fn}: sliding-window attention (use_sliding_window / layer_types) is not "
                    "supported; every layer must be 'full_attention'."
                )
        heads = f.integer("num_attention_heads")
        rope_kw = _rope_scaling(f, rope, rtype, _rope_field(c))
        theta = rope.get("rope_theta")
        return cls(
            vocab_size=f.integer("vocab_size"),
            hidden_size=f.integer("hidden_size"),
            num_layers=f.integer("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=f.integer("num_key_value_heads", heads),
            intermediate_size=f.integer("intermediate_size"),
            head_dim=f.integer("head_dim", None),
            rms_norm_eps=f.positive("rms_norm_eps", 1e-6),
            rope_theta=(
                f.positive("rope_theta", 10000.0)
                if theta is None
                else f.positive("rope_theta", label=f"{_rope_field(c)}.rope_theta", c=rope)
            ),
            rope_type=rtype,
            max_position_embeddings=f.integer("max_position_embeddings", 8192),
            tie_word_embeddings=f.boolean("tie_word_embeddings", False),
            qk_norm=mt == "qwen3",
            attention_bias=f.boolean("attention_bias", False),
            mlp_bias=f.boolean("mlp_bias", False),
            model_type=mt,
            **rope_kw,
        )


_REQUIRED: Any = object()


#: a config value, cut short for a message (a config.json's values can be long)
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4


def _given(x: Any) -> str:
    """What the file holds, for a message: a short repr and its type."""
    return f"{_REPR.repr(x)} ({type(x).__name__})"


def _json_kind(x: Any) -> str:
    """The JSON name of a parsed value's type, for messages."""
    if isinstance(x, Mapping):
        return "object"
    if isinstance(x, (list, tuple)):
        return "array"
    if isinstance(x, str):
        return "string"
    if isinstance(x, bool):
        return "boolean"
    if isinstance(x, (int, float)):
        return "number"
    return "null" if x is None else type(x).__name__


class _Fields:
    """Typed reads of a parsed ``config.json``'s fields: each wrong value is an
    :class:`InputError` naming the file (``fn``), the field, the value and what is expected.
    ``null`` counts as missing."""

    def __init__(self, fn: str, c: Mapping[str, Any]):
        self.fn, self.c = fn, c

    def fail(self, name: str, v: Any, expected: str) -> None:
        raise InputError(f"{self.fn}: {name}={_given(v)}; expected {expected}.")

    def _get(self, key, default, label, c, expected):
        c = self.c if c is None else c
        v = c.get(key)
        if v is None:
            if default is _REQUIRED:
                raise InputError(f"{self.fn}: {label or key} is missing; expected {expected}.")
            return None, True
        return v, False

    def integer(self, key: str, default: Any = _REQUIRED, *, label: str | None = None, c=None):
        """A positive JSON integer (a float with no fraction, such as ``16.0``, is read as 16)."""
        expected = "a positive integer"
        v, missing = self._get(key, default, label, c, expected)
        if missing:
            return default
        whole = isinstance(v, (int, np.integer)) or (
            isinstance(v, (float, np.floating)) and math.isfinite(v) and float(v).is_integer()
        )
        if isinstance(v, (bool, np.bool_)) or not whole or v < 1:
            self.fail(label or key, v, expected)
        return int(v)

    def positive(self, key: str, default: Any = _REQUIRED, *, label: str | None = None, c=None):
        """A finite positive JSON number, as a float."""
        expected = "a finite positive number"
        v, missing = self._get(key, default, label, c, expected)
        if missing:
            return default
        real = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(
            v, (bool, np.bool_)
        )
        try:
            fv = float(v) if real else math.nan
        except OverflowError:  # an integer beyond float range
            fv = math.inf
        if not (math.isfinite(fv) and fv > 0):
            self.fail(label or key, v, expected)
        return fv

    def boolean(self, key: str, default: Any = _REQUIRED, *, label: str | None = None, c=None):
        """A JSON boolean (``true``/``false``; never a string or number read by truthiness)."""
        expected = "a JSON boolean (true or false)"
        v, missing = self._get(key, default, label, c, expected)
        if missing:
            return default
        if not isinstance(v, (bool, np.bool_)):
            self.fail(label or key, v, expected)
        return bool(v)


def _rope_field(c: Mapping[str, Any]) -> str:
    """Which field holds the RoPE settings, for messages."""
    return "rope_parameters" if c.get("rope_parameters") else "rope_scaling"


def _hf_rope(fn: str, c: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """The RoPE settings of a ``config.json`` and their type, or the reason they are refused."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if not isinstance(rope, Mapping) or (
        rope and not ({"rope_type", "type", "rope_theta"} & set(rope))
    ):
        raise InputError(
            f"{fn}: rope parameters {rope!r} are not one dict with 'rope_type' (per-layer "
            "RoPE settings are not supported)."
        )
    rtype = rope.get("rope_type", rope.get("type", "default"))
    if not isinstance(rtype, str) or rtype not in ROPE_TYPES:
        raise InputError(
            f"{fn}: RoPE type {rtype!r}; this port implements {ROPE_TYPES} (Llama 3.1's "
            "'llama3' included)."
        )
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if isinstance(partial, (bool, np.bool_)) or partial != 1.0:
        raise InputError(f"{fn}: partial_rotary_factor={partial!r}; partial RoPE is not supported.")
    return rope, rtype


def _rope_scaling(f: _Fields, rope: Mapping[str, Any], rtype: str, field: str) -> dict[str, Any]:
    """The :class:`LlamaConfig` fields of linear / llama3 RoPE scaling (none for the default)."""
    out: dict[str, Any] = {}

    def real(key):
        return f.positive(key, label=f"{field}.{key}", c=rope)

    if rtype in ("linear", "llama3"):
        out["rope_factor"] = real("factor")
    if rtype == "llama3":
        out["rope_low_freq_factor"] = real("low_freq_factor")
        out["rope_high_freq_factor"] = real("high_freq_factor")
        out["rope_original_max_position"] = f.integer(
            "original_max_position_embeddings",
            label=f"{field}.original_max_position_embeddings",
            c=rope,
        )
    return out


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters to put on the decoder (Hu et al., 2021; PEFT's ``LoraConfig`` analogue).

    Attributes:
      rank: ``r``.
      alpha: ``lora_alpha``; the update is scaled by ``alpha / r`` (default ``alpha = r``).
      targets: projection names adapted in every layer, among ``ALL_TARGETS``
        (default ``("q_proj", "k_proj", "v_proj", "o_proj")``).
    """

    rank: int
    alpha: float | None = None
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        if (
            not isinstance(self.rank, (int, np.integer))
            or isinstance(self.rank, bool)
            or self.rank < 1
        ):
            raise InputError(f"LoRAConfig: rank={self.rank!r}; expected a positive int.")
        object.__setattr__(self, "targets", tuple(self.targets))
        bad = [t for t in self.targets if t not in ALL_TARGETS]
        if bad or not self.targets:
            raise InputError(
                f"LoRAConfig: targets {list(self.targets)} include unknown names {bad}; "
                f"choose among {ALL_TARGETS}."
            )
        if self.alpha is not None and not (np.isfinite(self.alpha) and self.alpha > 0):
            raise InputError(f"LoRAConfig: alpha={self.alpha!r}; expected a positive number.")

    @property
    def scale(self) -> float:
        """``alpha / r`` (1 when ``alpha`` is None)."""
        return 1.0 if self.alpha is None else float(self.alpha) / self.rank
