"""Loading: one PEFT adapter (:func:`load_adapter`), or several for one merge
(:func:`load_adapters`, :func:`check_compatible`), each as validate / read / convert steps."""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from .._core.checks import few
from ..errors import InputError
from ._common import CONFIG_NAME, check_flag, clip_repr, natural_key
from ._config import (
    check_lora_config,
    check_placement,
    check_same_base,
    module_settings,
    union_config,
)
from ._convert import check_factor_shapes, module_from_peft, peft_scale
from ._read import (
    adapter_directory,
    check_readable_dtype,
    factor_keys,
    factor_pair,
    load_config,
    open_weights,
    read_shapes,
    weights_file,
)

__all__ = [
    "LoadedAdapters",
    "check_adapter_set",
    "check_adapters_compatible",
    "check_compatible",
    "header_modules",
    "load_adapter",
    "load_adapters",
]


def load_adapter(path: str | os.PathLike, *, strict: bool = True) -> dict[str, dict[str, Any]]:
    """Load a PEFT LoRA adapter as a flat adapter keyed by PEFT module names.

    Reads ``adapter_config.json`` and ``adapter_model.safetensors`` (bf16 / fp16 weights are upcast
    to float32). A folder without ``adapter_model.safetensors`` may hold the pickled
    ``adapter_model.bin`` instead (``save_pretrained(..., safe_serialization=False)``): it is read
    in torch's zip format without torch and without running its pickle (only torch's tensor
    rebuilders are admitted; a pickle naming anything else is refused before anything is
    built). Module ``<module>``'s update in kernel layout is

    ``dK = scale * lora_a @ lora_b = scale * A^T B^T``, ``scale = lora_alpha / r`` (rsLoRA:
    ``lora_alpha / sqrt(r)``),

    with ``r`` and ``lora_alpha`` per module from ``rank_pattern`` / ``alpha_pattern``
    (:func:`pattern_key`) and the config's ``r`` / ``lora_alpha`` otherwise. Keys with an adapter
    name (``lora_A.default.weight``) are accepted. ``fan_in_fan_out`` needs no special handling:
    the factors have the same shapes either way (module docstring).

    The pattern keys are regular expressions from the file: plain ones are matched directly, any
    other is evaluated with Python's ``re`` (PEFT's rule, exactly) under a time limit, so a key
    that backtracks catastrophically is an error within a fraction of a second, not a hang.

    Args:
      path: the adapter directory (what ``PeftModel.save_pretrained`` wrote).
      strict: if True, refuse tensors that are not LoRA factors (``modules_to_save`` copies,
        trainable tokens, trained biases); if False, skip them (the merge then lacks them). The
        ``netutility`` command's flag for False is ``--skip-non-lora``.

    Returns:
      ``{name: {"lora_a": (d_in, r), "lora_b": (r, d_out), "scale": float}}`` with names like
      ``"model.layers.0.self_attn.q_proj"`` (no ``base_model.model.`` prefix), in natural order;
      arrays are ``jax.Array`` (float32, or float64 if stored so and x64 is on).

    Raises:
      FileNotFoundError: (:class:`MissingFileError`) missing directory or files, a file where the
        directory is expected, or a folder where a file is expected.
      PermissionError: (:class:`FileAccessError`) a file or folder exists but cannot be read.
      ValueError: (:class:`InputError`) an ``adapter_model.bin`` in torch's legacy (non-zip)
        format, corrupt, or whose pickle names any global but torch's tensor rebuilders, storage
        types and ``OrderedDict``; corrupt JSON or safetensors; a DoRA, lora_bias, QA-LoRA,
        aLoRA, target_parameters or unconverted PiSSA/OLoRA/CorDA/LoRA-GA adapter; LoRA on
        embeddings or convolutions; several adapter names in one file; a lora_A without its
        lora_B (or the reverse); factor shapes that disagree with each other or with ``r``;
        rank-0 factors; ``r`` not a positive integer;
        ``lora_alpha`` not a finite number; ``use_rslora`` not a boolean; a ``rank_pattern`` /
        ``alpha_pattern`` key that is not a valid regex or does not finish matching a module name
        within the time limit; non-LoRA tensors with ``strict=True``.
      TypeError: (:class:`InputTypeError`) non-floating factors; ``strict`` not a bool.

    Example:
      >>> import json, pathlib, tempfile
      >>> import numpy as np, safetensors.numpy
      >>> import netutility_jax as nu
      >>> from netutility_jax import peft
      >>> tmp = tempfile.TemporaryDirectory()
      >>> d = pathlib.Path(tmp.name)
      >>> _ = (d / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
      >>> A, B = np.ones((2, 3), np.float32), np.ones((5, 2), np.float32)  # (r, d_in), (d_out, r)
      >>> safetensors.numpy.save_file(
      ...     {"base_model.model.layer.q.lora_A.weight": A, "base_model.model.layer.q.lora_B.weight": B},
      ...     str(d / "adapter_model.safetensors"))
      >>> ad = peft.load_adapter(d)
      >>> ad["layer.q"]["lora_a"].shape, ad["layer.q"]["scale"]
      ((3, 2), 2.0)
      >>> bool(np.allclose(nu.module_update(ad["layer.q"]), 2.0 * (B @ A).T))
      True
      >>> tmp.cleanup()
    """
    fn = "nu.peft.load_adapter"
    check_flag(strict, "strict", fn=fn)
    with header_modules(path, strict=strict, fn=fn) as (wf, fh, modules):
        return {
            m.module: module_from_peft(
                fh.get_tensor(m.keys[0]), fh.get_tensor(m.keys[1]), m.scale, m.keys, wf, fn=fn
            )
            for m in modules
        }


class _HeaderModule(NamedTuple):
    """One module of an adapter as its config and safetensors header describe it, checked."""

    module: str
    keys: tuple[str, str]  # its lora_A and lora_B tensor names
    shapes: tuple[tuple[int, ...], tuple[int, ...]]
    scale: float


@contextlib.contextmanager
def header_modules(path: Any, *, strict: bool, fn: str) -> Iterator[tuple]:
    """One adapter's folder opened with :func:`load_adapter`'s checks of its config and header:
    ``(weights file, open safetensors handle, modules)``, the modules (:class:`_HeaderModule`, in
    natural order) checked one at a time as they are iterated, so that a caller reading each
    module's tensors meets the first bad module's error where a whole read would."""
    d = adapter_directory(path, fn=fn)
    wf = weights_file(d, fn=fn)
    cfg = load_config(d)
    cf = d / CONFIG_NAME
    check_lora_config(cfg, cf, fn=fn)
    where = f"{str(cf)!r}"
    with open_weights(wf, fn=fn) as fh:
        shapes = read_shapes(fh, wf, fn=fn)
        factors = factor_keys(shapes, wf, strict=strict, fn=fn)
        names = sorted(factors, key=natural_key)
        settings = module_settings(cfg, names, where=where, fn=fn)

        def modules() -> Iterator[_HeaderModule]:
            for module, setting in zip(names, settings, strict=True):
                keys = factor_pair(module, factors[module], shapes, wf, fn=fn)
                for k in keys:  # (from the header: an unreadable dtype before any data)
                    check_readable_dtype(wf, k, fh.get_slice(k).get_dtype(), fn=fn)
                sa, sb = shapes[keys[0]], shapes[keys[1]]
                check_factor_shapes(module, keys, sa, sb, wf, fn=fn)
                scale = peft_scale(module, sa, sb, setting, wf=wf, where=where, fn=fn)
                yield _HeaderModule(module, keys, (sa, sb), scale)

        yield wf, fh, modules()


class LoadedAdapters(NamedTuple):
    """What :func:`load_adapters` returns.

    Attributes:
      adapters: one flat adapter per path (as from :func:`load_adapter`), ready for
        :func:`nu.merge_adapters`. Every adapter has every module of the union of the adapters'
        modules, in natural order, with ``None`` where that task lacks the module (it then
        contributes nothing there).
      config: the base-model fields of the first adapter's config (``base_model_name_or_path``,
        ``task_type``, ``target_modules``, ...; see ``CARRIED_FIELDS``), for
        :func:`save_adapter`'s ``base_config``. Its target fields cover every module of the
        union: where the first adapter's do not, ``target_modules`` is the union of the adapters'
        lists (when every adapter lists plain names without ``exclude_modules`` /
        ``layers_to_transform``), or the target fields are left out, so that
        :func:`save_adapter` writes the exact module names.
      coverage: ``{module: (task indices that have it, ...)}`` in the adapters' module order
        (computed from ``adapters``, so the tuple still unpacks as ``adapters, config``).
    """

    adapters: list[dict[str, dict[str, Any] | None]]
    config: dict[str, Any]

    @property
    def coverage(self) -> dict[str, tuple[int, ...]]:
        names = dict.fromkeys(n for ad in self.adapters for n in ad)
        return {
            n: tuple(i for i, ad in enumerate(self.adapters) if ad.get(n) is not None)
            for n in names
        }


def check_compatible(
    adapters: Sequence[Mapping[str, Any]],
    *,
    labels: Sequence[str] | None = None,
    strict_targets: bool = True,
) -> None:
    """Check that adapters fit the same base model: equal update shapes, and the same modules.

    Ranks may differ between adapters; the update shape ``(d_in, d_out)`` of a module may not,
    wherever two adapters both have it. A module whose value is ``None`` counts as absent.

    Args:
      adapters: flat adapters as from :func:`load_adapter` (``None`` values allowed).
      labels: how to name each adapter in messages (e.g. its path); default ``"adapter i"``.
      strict_targets: if True, the adapters must also have the same modules; if False, they may
        target different modules (a merge then takes the union, and a task contributes nothing
        where it lacks a module).

    Raises:
      ValueError: (:class:`InputError`) naming the first modules that one adapter lacks (with
        ``strict_targets=True``), or the first module whose ``(d_in, d_out)`` differs, with both
        shapes and both labels.

    Example:
      >>> import numpy as np
      >>> from netutility_jax import peft
      >>> a = {"q": {"lora_a": np.ones((8, 2)), "lora_b": np.ones((2, 4))}}
      >>> b = {"q": {"lora_a": np.ones((8, 3)), "lora_b": np.ones((3, 4))}}
      >>> peft.check_compatible([a, b])  # different ranks are fine
      >>> c = {"k": {"lora_a": np.ones((8, 3)), "lora_b": np.ones((3, 4))}}
      >>> peft.check_compatible([a, c], strict_targets=False)  # different modules too
    """
    fn = "nu.peft.check_compatible"
    check_flag(strict_targets, "strict_targets", fn=fn)
    check_adapters_compatible(adapters, labels, strict_targets=strict_targets, fn=fn)


def check_adapters_compatible(
    adapters: Sequence[Mapping[str, Any]],
    labels: Sequence[str] | None,
    *,
    strict_targets: bool,
    fn: str,
) -> None:
    if labels is None:
        labels = [f"adapter {i}" for i in range(len(adapters))]
    if len(labels) != len(adapters):
        raise InputError(f"{fn}: {len(labels)} labels for {len(adapters)} adapters.")
    if not adapters:
        raise InputError(f"{fn}: no adapters given.")
    present = [[n for n, m in ad.items() if m is not None] for ad in adapters]
    if strict_targets:
        ref, ref_label = set(present[0]), labels[0]
        for names, label in zip(present[1:], labels[1:], strict=True):
            have = set(names)
            for xs, x_has, lx, ly in (
                (present[0], have, ref_label, label),
                (names, ref, label, ref_label),
            ):
                missing = sorted((n for n in xs if n not in x_has), key=natural_key)
                if missing:
                    verb = "is" if len(missing) == 1 else "are"
                    raise InputError(
                        f"{fn}: {few(missing)} {verb} in {lx} but not in {ly}: the adapters "
                        "target different modules, which strict_targets=True (CLI: "
                        "--strict-targets) refuses. Pass strict_targets=False to merge the union "
                        "of their modules (a task contributes nothing where it lacks a module)."
                    )
    first: dict[str, tuple[tuple[int, int], str]] = {}
    for ad, names, label in zip(adapters, present, labels, strict=True):
        for name in names:
            shape = _update_shape(ad[name])
            if name not in first:
                first[name] = (shape, label)
                continue
            s0, l0 = first[name]
            if shape != s0:
                raise InputError(
                    f"{fn}: module {clip_repr(name)} has update shape (d_in, d_out) = {s0} in {l0} "
                    f"but {shape} in {label}; the adapters were trained on different base models "
                    "and cannot be merged."
                )


def _update_shape(mod: Mapping[str, Any]) -> tuple[int, int]:
    if "delta" in mod:
        return tuple(int(n) for n in mod["delta"].shape)  # type: ignore[return-value]
    return int(mod["lora_a"].shape[0]), int(mod["lora_b"].shape[1])


def check_adapter_set(
    fn: str,
    paths: Any,
    one: str,
    strict: Any,
    strict_targets: Any,
    allow_different_base: Any,
) -> tuple[list[dict[str, Any]], list[str]]:
    """What :func:`load_adapters` and :func:`open_adapters` check before any tensor: a non-empty
    list of folders (``one``: what to do for a single adapter), the options' types, every config
    (cheap), and the same base model unless ``allow_different_base``; ``(configs, labels)``."""
    if isinstance(paths, (str, os.PathLike)) or not isinstance(paths, Sequence) or not paths:
        raise InputError(
            f"{fn}: expected a non-empty list of adapter directories, got {clip_repr(paths)}; for "
            f"one adapter {one}."
        )
    for name, v in (
        ("strict", strict),
        ("strict_targets", strict_targets),
        ("allow_different_base", allow_different_base),
    ):
        check_flag(v, name, fn=fn)
    configs = [load_config(p) for p in paths]  # cheap: refuse different bases before the weights
    labels = [repr(os.fspath(p)) for p in paths]
    if not allow_different_base:
        check_same_base(configs, labels, fn=fn)
    return configs, labels


def load_adapters(
    paths: Sequence[str | os.PathLike],
    *,
    strict: bool = True,
    strict_targets: bool = False,
    allow_different_base: bool = False,
) -> LoadedAdapters:
    """Load several PEFT adapters for one merge and check they fit the same base model.

    Adapters of one base model may target different modules (one task on ``q_proj, v_proj``,
    another on every linear layer): the result covers the union of their modules, with ``None``
    where a task lacks one, which :func:`nu.merge_adapters` reads as "this task contributes nothing
    here". Update shapes must agree wherever two adapters have the same module.

    Args:
      paths: adapter directories, one per task.
      strict: as for :func:`load_adapter` (CLI: ``--skip-non-lora`` for False).
      strict_targets: if True, refuse adapters that target different modules instead of merging
        the union (CLI: ``--strict-targets``).
      allow_different_base: if True, accept adapters whose configs name different
        ``base_model_name_or_path`` (e.g. a Hub id and a local copy of the same model; CLI:
        ``--allow-different-base``). A config without a base model (missing, null or empty)
        names an unknown one and is never refused for it.

    Returns:
      :class:`LoadedAdapters` ``(adapters, config)`` with ``.coverage``; ``config`` holds the
      base-model fields of the first adapter's config (the others may differ only in training
      settings such as ``r``, and in their target modules), with target fields that cover the
      union of the modules.

    Raises:
      ValueError: (:class:`InputError`) no paths; different base models (naming both, and both
        paths) without ``allow_different_base``; different ``layer_replication`` (naming both
        adapters); a config whose target fields (``target_modules``, ``exclude_modules``,
        ``layers_to_transform``, ``layers_pattern``) leave out modules its own weights hold
        (every adapter is checked, naming it and the field); different update shapes of a module (naming
        it, both shapes and both paths); different modules with ``strict_targets=True``; a
        first config whose target fields are malformed or hold a regex that cannot be evaluated
        in time; everything :func:`load_adapter` raises.
      TypeError: (:class:`InputTypeError`) an option that is not a bool.
      FileNotFoundError, PermissionError: as for :func:`load_adapter`.
    """
    fn = "nu.peft.load_adapters"
    configs, labels = check_adapter_set(
        fn, paths, "use nu.peft.load_adapter(path)", strict, strict_targets, allow_different_base
    )
    loaded = [load_adapter(p, strict=strict) for p in paths]
    files = [str(pathlib.Path(os.fspath(p)) / CONFIG_NAME) for p in paths]
    check_placement(configs, labels, [list(ad) for ad in loaded], files=files, fn=fn)
    check_adapters_compatible(loaded, labels, strict_targets=strict_targets, fn=fn)
    names = sorted({n for ad in loaded for n in ad}, key=natural_key)
    adapters = [{n: ad.get(n) for n in names} for ad in loaded]
    where = f"{str(pathlib.Path(os.fspath(paths[0])) / CONFIG_NAME)!r}: "
    return LoadedAdapters(adapters, union_config(configs, names, where=where, fn=fn))
