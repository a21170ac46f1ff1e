"""PEFT interop: load LoRA adapters saved by Hugging Face PEFT, save merges PEFT can load.

A PEFT LoRA checkpoint is a directory with ``adapter_config.json`` and
``adapter_model.safetensors``. The weights of module ``<module>`` (its dotted name in the base
``transformers`` model, e.g. ``model.layers.0.self_attn.q_proj``) are

* ``base_model.model.<module>.lora_A.weight``, shape ``(r, d_in)``, and
* ``base_model.model.<module>.lora_B.weight``, shape ``(d_out, r)``,

and PEFT adds ``scale * B A`` (``(d_out, d_in)``, the torch ``Linear`` layout) to the base weight,
with ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``). The per-module
``r`` and ``lora_alpha`` come from ``rank_pattern`` / ``alpha_pattern`` when a key matches
(:func:`pattern_key`). In this library's kernel layout the same update is
``dK = scale * lora_a @ lora_b`` with ``lora_a = A^T`` ``(d_in, r)`` and ``lora_b = B^T``
``(r, d_out)``.

``fan_in_fan_out`` (GPT-2's ``Conv1D``, whose weight is stored ``(d_in, d_out)``) changes only how
PEFT adds the update to the stored base weight; the LoRA factors are ordinary ``Linear`` layers with
the shapes above either way, so they load and save the same. ``dK`` is then exactly the update of
the ``Conv1D`` weight as stored.

Files are read and written with the ``safetensors`` package (its numpy and flax routes, so bf16
works); torch and PEFT are never imported. A folder that holds the pickled ``adapter_model.bin``
(``save_pretrained(..., safe_serialization=False)``) instead of ``adapter_model.safetensors`` is
read too, in torch's zip format, by a restricted unpickler that admits only torch's tensor
rebuilders (as stand-ins that call nothing) and refuses any other global before anything is
built, so a hostile pickle runs nothing (:mod:`._torch_pickle`); torch's legacy non-zip format is
refused. The regular expressions a config may hold (``rank_pattern`` / ``alpha_pattern`` keys, a
string ``target_modules`` / ``exclude_modules``, ``layers_pattern``) follow PEFT's rules exactly
and never hang: plain name patterns are matched directly, any other is run by Python's ``re`` in
a short-lived helper process with a time limit, and one that does not finish is an error.

The package is laid out by step: :mod:`._read` (paths, the JSON config, safetensors keys and
shapes), :mod:`._torch_pickle` (the tensors of a pickled ``adapter_model.bin``, without torch),
:mod:`._config` (what the config means: refused settings, per-module ``r`` / ``lora_alpha``,
target modules, carried fields), :mod:`._regex` (PEFT's regex rules, bounded),
:mod:`._convert` (PEFT tensors <-> modules, scales), :mod:`._load` (:func:`load_adapter`,
:func:`load_adapters`), :mod:`._write` (:func:`save_adapter`) and :mod:`._stream`
(:class:`AdapterWriter`: the same, written a chunk of modules at a time) and :mod:`._shards`
(:func:`weight_shapes` from the headers alone; :func:`write_shard` and :func:`write_index`: a
merged adapter written as shards, one per process of a distributed merge).
"""

from __future__ import annotations

from ._common import CONFIG_NAME as CONFIG_NAME
from ._common import PICKLE_NAME as PICKLE_NAME
from ._common import PREFIX as PREFIX
from ._common import WEIGHTS_NAME as WEIGHTS_NAME
from ._common import save_tensors as save_tensors
from ._config import CARRIED_FIELDS as CARRIED_FIELDS
from ._convert import truncate_dense as truncate_dense
from ._lazy import AdapterSet as AdapterSet
from ._lazy import open_adapters as open_adapters
from ._load import LoadedAdapters as LoadedAdapters
from ._load import check_compatible as check_compatible
from ._load import load_adapter as load_adapter
from ._load import load_adapters as load_adapters
from ._read import INDEX_NAME as INDEX_NAME
from ._read import load_config as load_config
from ._read import read_tensors as read_tensors
from ._regex import pattern_key as pattern_key
from ._shards import shard_name as shard_name
from ._shards import weight_shapes as weight_shapes
from ._shards import write_index as write_index
from ._shards import write_shard as write_shard
from ._stream import AdapterWriter as AdapterWriter
from ._write import VLLM_RANKS as VLLM_RANKS
from ._write import save_adapter as save_adapter
from ._write import serving_ranks as serving_ranks

__all__ = [
    "CARRIED_FIELDS",
    "CONFIG_NAME",
    "INDEX_NAME",
    "VLLM_RANKS",
    "WEIGHTS_NAME",
    "AdapterSet",
    "AdapterWriter",
    "LoadedAdapters",
    "check_compatible",
    "load_adapter",
    "load_adapters",
    "load_config",
    "open_adapters",
    "pattern_key",
    "read_tensors",
    "save_adapter",
    "save_tensors",
    "serving_ranks",
    "shard_name",
    "truncate_dense",
    "weight_shapes",
    "write_index",
    "write_shard",
]
# Also importable: PICKLE_NAME and PREFIX (the CLI and tests use them).

# The public functions and LoadedAdapters are documented, pickled and doctested as
# nu.peft.<name>, where they have always lived.
for _obj in (
    AdapterSet,
    AdapterWriter,
    open_adapters,
    LoadedAdapters,
    check_compatible,
    load_adapter,
    load_adapters,
    load_config,
    pattern_key,
    read_tensors,
    save_adapter,
    save_tensors,
    serving_ranks,
    shard_name,
    truncate_dense,
    weight_shapes,
    write_index,
    write_shard,
):
    _obj.__module__ = __name__
del _obj
