"""The vision suite's given adapters (:mod:`vision`) and the up-front checks of its folders.

One PEFT LoRA folder per dataset (``adapter_config.json`` and ``adapter_model.safetensors`` or
the pickled ``adapter_model.bin``, read without torch by ``nu.peft.load_adapter``:
:func:`load_adapter`), named ``NAME=DIR`` or matched by folder name (``..._dtd``) or else by
order (:data:`vision_data.ORDER`: :func:`match_adapters`). Module names are mapped to the vision
tower (:func:`vision_names`): PEFT on ``CLIPModel`` or ``CLIPVisionModel``
(``vision_model.encoder.layers.N...``) and PEFT on the tower itself, as KnOTS trains
(``encoder.layers.N...``). :func:`check_folders` checks the model, data and adapter folders
before any work (``netutility demo --suite vision``'s up-front checks).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...errors import InputError, MissingFileError
from ..data import vision_data as vd
from ..harness.suites import require_modules

__all__ = [
    "check_folders",
    "load_adapter",
    "match_adapters",
    "vision_names",
]

_VISION = re.compile(
    r"(?:^|\.)(?:vision_model\.)?(encoder\.layers\.\d+\."
    r"(?:self_attn\.(?:q_proj|k_proj|v_proj|out_proj)|mlp\.(?:fc1|fc2)))$"
)


def vision_names(adapter: Mapping[str, Any], *, where: str = "adapter") -> dict[str, Any]:
    """An adapter's modules renamed to CLIP's vision tower (``vision_model.encoder.layers.N.
    self_attn.q_proj``): PEFT on ``CLIPModel`` / ``CLIPVisionModel`` keeps its names, PEFT on the
    tower itself (KnOTS: ``get_peft_model(model.vision_model, ...)``, names
    ``encoder.layers.N...``) gains the ``vision_model.`` prefix.

    Raises:
      InputError: a text-tower module (the heads are the base text tower's), a name that is not
        a linear layer of the vision tower's encoder, two names for one module.

    Example:
      >>> list(vision_names({"encoder.layers.0.self_attn.q_proj": 1}))
      ['vision_model.encoder.layers.0.self_attn.q_proj']
    """
    out: dict[str, Any] = {}
    for name, mod in adapter.items():
        if "text_model" in name:
            raise InputError(
                f"{where}: module {name!r} is in CLIP's text tower; the vision suite folds "
                "adapters into the vision tower only (its heads are the base text tower's)."
            )
        m = _VISION.search(name)
        if m is None:
            raise InputError(
                f"{where}: module {name!r} is not a linear layer of CLIP's vision encoder "
                "(expected names like 'vision_model.encoder.layers.0.self_attn.q_proj' or, PEFT "
                "on the tower itself, 'encoder.layers.0.self_attn.q_proj')."
            )
        new = "vision_model." + m.group(1)
        if new in out:
            raise InputError(f"{where}: two modules map to {new!r}.")
        out[new] = mod
    return out


def match_adapters(args: Sequence[Any]) -> dict[str, pathlib.Path]:
    """``{dataset: folder}`` from ``--adapters`` items (``suites.AdapterArg``: ``name`` or None,
    ``path``): a named item is that dataset's; a bare folder is the dataset its name ends with
    (``KnOTS-ViT-B-32_lora_R16_dtd`` -> ``dtd``), else the next unmatched dataset of
    :data:`vision_data.ORDER` in order.

    Raises:
      InputError: a dataset given twice, more bare folders than datasets left, fewer than 2.
    """
    out: dict[str, pathlib.Path] = {}
    bare = []

    def add(name: str, path: Any) -> None:
        if name in out:
            raise InputError(f"--adapters: dataset {name!r} is given twice ({out[name]}, {path})")
        out[name] = pathlib.Path(path)

    for a in args:
        if a.name is not None:
            add(a.name, a.path)
            continue
        base = pathlib.Path(a.path).name.lower()
        hit = next((d for d in vd.ORDER if base == d or re.search(rf"[_\-.]{d}$", base)), None)
        if hit is not None:
            add(hit, a.path)
        else:
            bare.append(a.path)
    free = [d for d in vd.ORDER if d not in out]
    if len(bare) > len(free):
        raise InputError(
            f"--adapters: {len(bare)} folder(s) without a dataset name and only {len(free)} "
            "dataset(s) left; name them: --adapters dtd=DIR,eurosat=DIR,..."
        )
    for d, path in zip(free, bare, strict=False):
        add(d, path)
    if len(out) < 2:
        raise InputError(f"--adapters: merging needs at least 2 adapters, got {len(out)}")
    return out


def _digest(paths: Sequence[pathlib.Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _adapter_files(d: pathlib.Path) -> list[pathlib.Path]:
    from ... import peft

    files = [d / peft.CONFIG_NAME]
    for name in (peft.WEIGHTS_NAME, peft.PICKLE_NAME):
        if (d / name).is_file():
            return [*files, d / name]
    return files


def load_adapter(
    name: str, folder: str | os.PathLike, num_layers: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Dataset ``name``'s adapter from its PEFT ``folder`` (vision-tower names,
    :func:`vision_names`; float32 numpy factors) and its info (the fields of a trained task's
    ``info`` the runner records; ``cache_key`` the digest of the adapter's files).

    Raises:
      InputError: a module that is not a linear layer of the vision encoder, or of a layer beyond
        the model's ``num_layers``.
    """
    import netutility_jax as nu

    d = pathlib.Path(folder)
    where = f"--adapters {name}={d}"
    t0 = time.perf_counter()
    raw = nu.peft.load_adapter(d)
    adapter = vision_names(raw, where=where)
    from ..models import clip

    for n, p in zip(adapter, clip.nnx_names(adapter), strict=True):
        parts = [int(x) if x.isdigit() else x for x in p.split("/")]
        if parts[3] >= num_layers:
            raise InputError(
                f"{where}: module {n!r} names layer {parts[3]} but the model's vision tower "
                f"has {num_layers}; is the adapter for another CLIP?"
            )
    adapter = {
        n: {
            "lora_a": np.asarray(m["lora_a"], np.float32),
            "lora_b": np.asarray(m["lora_b"], np.float32),
            "scale": float(m["scale"]),
        }
        for n, m in adapter.items()
    }
    cfg = nu.peft.load_config(d)
    ranks = {int(m["lora_a"].shape[1]) for m in adapter.values()}
    files = _adapter_files(d)
    info = {
        "cache_key": _digest(files),
        "source": str(d),
        "files": [f.name for f in files],
        "modules": len(adapter),
        "r": max(ranks),
        "lora_alpha": float(cfg.get("lora_alpha", max(ranks))),
        "loaded": True,
        "steps": 0,
        "best_step": 0,
        "best_val_accuracy": float("nan"),
        "stopped_early": False,
        "train_seconds": time.perf_counter() - t0,
        "tokens_per_second": float("nan"),
        "history": [],
        "cache_hit": False,
    }
    return adapter, info


def check_folders(
    model_dir: Any = None,
    data_dir: Any = None,
    adapters: Sequence[Any] | None = None,
    model_devices: int | None = None,
    min_bytes: int | None = None,
) -> None:
    """The up-front checks of ``netutility demo --suite vision`` (before any work): every flag
    given, the model folder's files, each adapter folder's files, each dataset's folder with a
    test split, and the readers the files need (``model_devices`` and ``min_bytes``, checked by
    ``netutility demo``, are not looked at).

    Raises:
      InputError: a missing flag, file or reader (one line, naming the flag; the suite's spec
        turns it into ``suites.SuiteUnavailable``).
    """
    missing = [
        f for f, v in (("--model-dir", model_dir), ("--data-dir", data_dir), ("--adapters", adapters))
        if not v
    ]  # fmt: skip
    if missing:
        raise InputError(
            f"the vision suite needs {', '.join(missing)}: --model-dir CLIP_FOLDER (config.json, "
            "model.safetensors, tokenizer.json), --data-dir DATA (DATA/<dataset>/test/...) and "
            "--adapters NAME=DIR,... (PEFT LoRA folders)"
        )
    require_modules(
        [("tokenizers", "tokenizers"), ("PIL", "pillow"), ("safetensors", "safetensors")],
        lambda _, what: InputError(f"the vision suite needs {what}: pip install {what}"),
    )
    m = pathlib.Path(model_dir)
    for f in ("config.json", "tokenizer.json"):
        if not (m / f).is_file():
            raise InputError(f"--model-dir {m}: no {f} (a Hugging Face CLIPModel folder)")
    if not ((m / "model.safetensors").is_file() or (m / "model.safetensors.index.json").is_file()):
        extra = " (pytorch_model.bin is not read)" if (m / "pytorch_model.bin").exists() else ""
        raise InputError(f"--model-dir {m}: no model.safetensors{extra}")
    matched = match_adapters(adapters)
    from ... import peft

    for name, d in matched.items():
        if not (d / peft.CONFIG_NAME).is_file():
            raise InputError(f"--adapters {name}={d}: no {peft.CONFIG_NAME} (a PEFT folder)")
        if len(_adapter_files(d)) < 2:
            raise InputError(f"--adapters {name}={d}: no {peft.WEIGHTS_NAME} or {peft.PICKLE_NAME}")
        try:
            ds = vd.dataset_dir(data_dir, name)
        except MissingFileError as e:
            raise InputError(str(e)) from None
        found = vd.find_split(ds, "test")
        if found is None:
            raise InputError(
                f"--data-dir: {ds} has no test split ({ds}/test/<class>/*.jpg or "
                f"{ds}/test-*.parquet)"
            )
        if any(
            f is not None and f.kind == "parquet"
            for f in (found, vd.find_split(ds, "val"), vd.find_split(ds, "train"))
        ):
            try:
                vd.parquet_reader()
            except vd.VisionDataError:
                raise InputError(
                    f"--data-dir: {ds} holds parquet files; reading them needs pyarrow: pip "
                    "install pyarrow"
                ) from None
