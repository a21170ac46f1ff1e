"""Flax nnx interop: read the LoRA adapter out of an ``nnx`` model, and write a merge back in.

A LoRA layer is an ``nnx.LoRA`` (standalone, or wrapping a ``base_module`` such as an
``nnx.Linear``) or an ``nnx.LoRALinear`` (an ``nnx.Linear`` whose ``lora`` child is an
``nnx.LoRA``). Both store ``lora_a (d_in, r)`` and ``lora_b (r, d_out)`` as ``nnx.LoRAParam`` and
compute ``x @ lora_a @ lora_b`` with **no scaling**: flax has no ``lora_alpha``. So a module's
``scale`` is 1 unless

* the ``nnx.LoRA`` module has a ``scale`` attribute (a number, a scalar array or an
  ``nnx.Variable`` holding one), as a subclass that computes ``scale * x @ lora_a @ lora_b`` would
  store it (for an ``nnx.LoRALinear`` that is ``layer.lora.scale``); or
* the caller passes ``scale=`` (a float, or ``{name: float}``), for a scaling the training code
  applies outside the layer (e.g. ``lora_alpha / r``).

Module names. A LoRA layer has two spellings, and this module reads both:

* its **layer name** (the default of :func:`extract_adapter`), the "/"-joined state path of the
  layer: the ``nnx.LoRALinear`` itself (``"layers/0/attention/query"``) or the ``nnx.LoRA``
  module; a model that is itself a single LoRA layer has the one module ``"lora"``;
* its **path name** (``names="path"``), the "/"-joined state path of its ``nnx.LoRA`` module,
  which is the name :func:`nu.score`, :func:`nu.allocate` and :func:`nu.merge` give a module of
  an ``nnx.State`` passed to them directly: ``"layers/0/attention/query/lora"`` for an
  ``nnx.LoRALinear``, the same as the layer name for an ``nnx.LoRA`` (``""`` for a root one).

So the mapping is: a layer name ``X`` of an ``nnx.LoRALinear`` is the path name ``X/lora``; an
``nnx.LoRA``'s two names agree (``"lora"`` and ``""`` at the root). Masks, scores and merges from
one spelling fit adapters of the same spelling: ``nu.score(states)`` goes with
``extract_adapter(model, names="path")``, ``nu.score([extract_adapter(s) for s in states])``
with ``extract_adapter(model)``. Every ``{name: ...}`` argument here (``scale=``, the merged
adapter of :func:`apply_adapter`) takes either spelling.

What a training script saves per task is often not the model but its LoRA state,
``nnx.state(model, nnx.LoRAParam)`` (an ``nnx.State``, its ``to_pure_dict()``, or what orbax's
``StandardCheckpointer.restore(path)`` gives back with or without a target):
:func:`extract_adapter` takes that too and names its modules as it names the model's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ._core import tree as _tree
from ._core.checks import brief
from .errors import InputError, InputTypeError
from .pipeline.merging import module_update

__all__ = ["MODES", "NAMINGS", "apply_adapter", "extract_adapter"]

MODES = ("fold", "lora")
NAMINGS = ("layer", "path")  # extract_adapter's names=: see the module docstring


@dataclasses.dataclass(frozen=True)
class _Layer:
    """One LoRA layer of a model: its nnx.LoRA, and the base kernel the update folds into."""

    name: str  # its layer name
    path: str  # its path name: the nnx.LoRA module's "/"-joined state path
    lora: nnx.LoRA
    base: Any  # the module holding the base `kernel` (LoRALinear, or LoRA.base_module), or None


def _lora_layers(model: Any, fn: str) -> dict[str, _Layer]:
    if not isinstance(model, nnx.Module):
        raise InputTypeError(f"{fn}: expected a flax.nnx.Module, got {type(model).__name__}.")
    mods = dict(nnx.iter_modules(model))
    out: dict[str, _Layer] = {}
    for path, mod in mods.items():
        if not isinstance(mod, nnx.LoRA):
            continue
        lora_path = "/".join(map(str, path))
        parent = mods.get(path[:-1]) if path else None
        if path and path[-1] == "lora" and isinstance(parent, nnx.LoRALinear):
            path, base = path[:-1], parent
        else:
            base = mod.base_module
        # a model that is itself one LoRA layer: "lora", as nu.merge names a root module
        name = "/".join(map(str, path)) or "lora"
        out[name] = _Layer(name, lora_path, mod, base)
    if not out:
        raise InputError(
            f"{fn}: {type(model).__name__} has no LoRA layers (nnx.LoRA or nnx.LoRALinear); "
            "build the model with LoRA layers (e.g. nnx.LoRALinear(d_in, d_out, lora_rank=r))."
        )
    return out


def _scalar(fn: str, name: str, x: Any, what: str) -> float | jax.Array:
    x = _tree.unwrap(x)
    if isinstance(x, jax.core.Tracer):
        return x
    arr = np.asarray(x)
    if arr.shape != () or not jnp.issubdtype(arr.dtype, jnp.number) or not np.isfinite(arr):
        raise InputError(
            f"{fn}: {what} of module {name!r} is {x!r}; expected a finite scalar (the factor the "
            "forward applies to x @ lora_a @ lora_b)."
        )
    return float(arr)


def _resolve(keys: Any, spellings: Mapping[str, str]) -> tuple[dict[Any, str], list[Any]]:
    """Each key's module name, where the key is that name or the module's other spelling.

    ``spellings`` maps each module name to its other spelling (a layer name to its path name or
    back, see the module docstring). Returns ``({key: module name}, keys that are neither)``; a
    name that is one module's name and another's other spelling means the first.
    """
    other = {}
    for name, alt in spellings.items():
        other.setdefault(alt, name)
    found, unknown = {}, []
    for k in keys:
        if k in spellings:
            found[k] = k
        elif k in other:
            found[k] = other[k]
        else:
            unknown.append(k)
    return found, unknown


def _names_list(names: Any) -> str:
    names = list(names)
    return f"{names[:5]}{' ...' if len(names) > 5 else ''}"


def _scale_map(
    fn: str, scale: Mapping[str, Any], spellings: Mapping[str, str], where: str
) -> dict[str, Any]:
    """A ``scale=`` mapping keyed by module name; its keys may use either spelling."""
    found, unknown = _resolve(scale.keys(), spellings)
    if unknown:
        raise InputError(
            f"{fn}: scale names {sorted(map(str, unknown))[:3]} are not LoRA layers of the "
            f"{where}; they are {_names_list(spellings)} (or their path names "
            f"{_names_list(spellings.values())})."
        )
    out: dict[str, Any] = {}
    first: dict[str, Any] = {}
    for k, name in found.items():
        if name in out:
            raise InputError(
                f"{fn}: scale names {first[name]!r} and {k!r} are the same LoRA layer (its layer "
                "name and its path name); give its scale once."
            )
        out[name], first[name] = scale[k], k
    return out


def _scales(
    fn: str, layers: Mapping[str, _Layer], scale: float | Mapping[str, float] | None
) -> dict[str, float | jax.Array]:
    given = (
        _scale_map(fn, scale, {n: lay.path for n, lay in layers.items()}, "model")
        if isinstance(scale, Mapping)
        else {}
    )
    out: dict[str, float | jax.Array] = {}
    for name, layer in layers.items():
        if name in given:
            out[name] = _scalar(fn, name, given[name], "scale")
        elif scale is not None and not isinstance(scale, Mapping):
            out[name] = _scalar(fn, name, scale, "scale")
        elif hasattr(layer.lora, "scale"):
            out[name] = _scalar(fn, name, layer.lora.scale, "the layer's `scale` attribute")
        else:
            out[name] = 1.0
    return out


def _layer_name(path: str) -> str:
    """The layer name of a LoRA state path: ``a/query/lora`` (an ``nnx.LoRALinear``'s ``lora``
    child) is ``a/query``; a root ``lora`` (a root ``nnx.LoRALinear``'s) and the root ``""`` (a
    root ``nnx.LoRA``) are ``lora``, as :func:`extract_adapter` names a model that is one LoRA
    layer."""
    if path in ("", "lora"):
        return "lora"
    return path[: -len("/lora")] if path.endswith("/lora") else path


_RESTORE_FIX = (
    "restore with a target, checkpointer.restore(path, nnx.state(model, nnx.LoRAParam)), or "
    "pass the model"
)


def _state_value(fn: str, name: str, label: str, x: Any) -> Any:
    """An entry of a LoRA state as an array: an nnx Variable's value, or the ``{'value': array}``
    mapping that orbax's ``StandardCheckpointer.restore(path)`` gives back for a Variable when
    it restores without a target (it does not know the Variable types then)."""
    x = _tree.unwrap(x)
    if _tree.is_mapping(x):
        keys = list(x.keys())
        if "value" not in keys:
            raise InputError(
                f"{fn}: {label} of module {name!r} is a {type(x).__name__} with keys "
                f"{brief(sorted(map(str, keys)))}; expected an array, an nnx Variable, or "
                "{'value': array} (a Variable as orbax's StandardCheckpointer.restore(path) "
                f"gives it back without a target). Or {_RESTORE_FIX}."
            )
        x = _tree.unwrap(x["value"])
    return x


def _state_factor(fn: str, name: str, label: str, x: Any) -> Any:
    """A factor of a LoRA state (see :func:`_state_value`), checked: a 2-D floating array."""
    x = _state_value(fn, name, label, x)
    arr = x
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        try:
            arr = np.asarray(x)
        except Exception:  # ragged lists and such: not an array at all
            arr = None
    try:
        floating = arr is not None and bool(jnp.issubdtype(arr.dtype, jnp.floating))
    except TypeError:
        floating = False
    want = "(d_in, r)" if label == "lora_a" else "(r, d_out)"
    if not floating:
        what = f"an array of dtype {arr.dtype}" if arr is not None else f"a {type(x).__name__}"
        raise InputTypeError(
            f"{fn}: {label} of module {name!r} is {what}; expected a floating array {want}. "
            f"If the state was read from a checkpoint, {_RESTORE_FIX}."
        )
    if len(arr.shape) != 2:
        raise InputError(
            f"{fn}: {label} of module {name!r} has shape {tuple(arr.shape)}; expected 2-D {want}."
        )
    return arr


def _from_state(fn: str, state: Any, scale: float | Mapping[str, float] | None, names: str) -> dict:
    """The adapter of an ``nnx.State`` (or plain nested dict) of LoRA parameters, including
    an orbax restore without a target (each Variable a ``{'value': array}`` mapping)."""
    found = _tree.extract_lora(state)
    if not found:
        raise InputError(
            f"{fn}: the {type(state).__name__} holds no LoRA layer (a mapping with both "
            "'lora_a' and 'lora_b'); pass a model with LoRA layers, or its LoRA state "
            "nnx.state(model, nnx.LoRAParam)."
        )
    # {module name: (its other spelling, module)}
    mods: dict[str, tuple[str, Mapping[str, Any]]] = {}
    for path, mod in found.items():
        layer = _layer_name(path)
        if names == "path":
            mods[path] = (layer, mod)
            continue
        if layer in mods:
            raise InputError(
                f"{fn}: the state has two LoRA layers named {layer!r} ({mods[layer][0]!r} and "
                f"{path!r}); pass names='path' (their state paths) or the model itself."
            )
        mods[layer] = (path, mod)
    given = (
        _scale_map(fn, scale, {n: alt for n, (alt, _) in mods.items()}, "state")
        if isinstance(scale, Mapping)
        else {}
    )
    out = {}
    for name, (_, mod) in mods.items():
        if name in given:
            sc = _scalar(fn, name, given[name], "scale")
        elif scale is not None and not isinstance(scale, Mapping):
            sc = _scalar(fn, name, scale, "scale")
        elif "scale" in mod:
            value = _state_value(fn, name, "scale", mod["scale"])
            sc = _scalar(fn, name, value, "the state's `scale` entry")
        else:
            sc = 1.0
        a = _state_factor(fn, name, "lora_a", mod["lora_a"])
        b = _state_factor(fn, name, "lora_b", mod["lora_b"])
        if a.shape[1] != b.shape[0]:
            raise InputError(
                f"{fn}: factors of module {name!r} do not chain: lora_a {tuple(a.shape)} is "
                f"(d_in, r={a.shape[1]}) but lora_b {tuple(b.shape)} is (r={b.shape[0]}, d_out)."
            )
        out[name] = {
            "lora_a": jnp.array(a, copy=True),
            "lora_b": jnp.array(b, copy=True),
            "scale": sc,
        }
    return out


def extract_adapter(
    model: Any,
    *,
    scale: float | Mapping[str, float] | None = None,
    names: str = "layer",
) -> dict[str, dict[str, Any]]:
    """The LoRA adapter of an nnx model (or of its LoRA state), as a flat dict keyed by layer path.

    Every ``nnx.LoRA`` / ``nnx.LoRALinear`` layer becomes a module
    ``{"lora_a": (d_in, r), "lora_b": (r, d_out), "scale": ()}`` whose update in kernel layout is
    ``dK = scale * lora_a @ lora_b``: the input :func:`nu.score` and :func:`nu.merge_adapters`
    take, one per task.

    Args:
      model: an ``nnx.Module`` with LoRA layers, or its LoRA state (``nnx.state(model,
        nnx.LoRAParam)``, an ``nnx.State``, the plain nested dict ``to_pure_dict()`` gives, or
        what orbax's ``StandardCheckpointer.restore(path)`` returns, with a target or without
        one (then each Variable is a ``{"value": array}`` dict)), whose modules get the names
        the model's would.
      scale: the factor the forward applies to each LoRA branch, if not stored on the layers: a
        float for all, or ``{name: float}`` (layer or path names). Default: the ``nnx.LoRA``
        module's ``scale`` attribute (a state's ``scale`` entry) where it has one, else 1
        (flax's LoRA layers do not scale).
      names: ``"layer"``: each module named by its layer (``"layers/0/query"`` for an
        ``nnx.LoRALinear``); ``"path"``: by the state path of its ``nnx.LoRA``
        (``"layers/0/query/lora"``), the names :func:`nu.score` and :func:`nu.merge` give an
        ``nnx.State`` passed to them directly, so that their masks fit this adapter.

    Returns:
      ``{name: {"lora_a", "lora_b", "scale"}}`` in model traversal order; factors are copies
      (``jax.Array``, their dtype kept), ``scale`` a Python float.

    Raises:
      TypeError: ``model`` is neither an ``nnx.Module`` nor a mapping; a state's factor is not a
        floating array.
      ValueError: the model (or state) has no LoRA layers; unknown ``names``; a state's factors
        that are not 2-D or do not chain; a ``scale`` that is not a finite scalar, or names a
        layer the model lacks.

    Example:
      >>> from flax import nnx
      >>> import netutility_jax as nu
      >>> model = nnx.LoRALinear(8, 4, lora_rank=2, rngs=nnx.Rngs(0))
      >>> ad = nu.nnx.extract_adapter(model)
      >>> {k: v["lora_a"].shape for k, v in ad.items()}, ad["lora"]["scale"]
      ({'lora': (8, 2)}, 1.0)
    """
    fn = "nu.nnx.extract_adapter"
    if not isinstance(names, str) or names not in NAMINGS:
        raise InputError(
            f"{fn}: names={names!r}; expected 'layer' (a module named by its layer, "
            "'layers/0/query') or 'path' (by its nnx.LoRA's state path, 'layers/0/query/lora', "
            "as nu.score names an nnx.State's modules)."
        )
    if not isinstance(model, nnx.Module) and _tree.is_mapping(model):
        return _from_state(fn, model, scale, names)
    layers = _lora_layers(model, fn)
    scales = _scales(fn, layers, scale)
    return {
        (name if names == "layer" else layer.path): {
            "lora_a": jnp.array(layer.lora.lora_a.get_value(), copy=True),
            "lora_b": jnp.array(layer.lora.lora_b.get_value(), copy=True),
            "scale": scales[name],
        }
        for name, layer in layers.items()
    }


def _merged_modules(
    fn: str, merged: Any, layers: Mapping[str, _Layer] | None = None
) -> dict[str, Mapping[str, Any] | None]:
    if not _tree.is_mapping(merged):
        raise InputTypeError(
            f"{fn}: merged is a {type(merged).__name__}; expected the adapter returned by "
            "nu.merge / nu.merge_adapters ({name: module})."
        )
    out: dict[str, Mapping[str, Any] | None] = {}
    for path, node in _tree.walk_modules(merged, is_module=_tree.has_update, max_depth=None):
        name = "/".join(path)
        if node is not None and not _tree.is_mapping(node):
            raise InputError(
                f"{fn}: merged has a leaf at {name!r} ({type(node).__name__}) outside any module; "
                "expected {name: {'lora_a', 'lora_b', 'scale'}} or {name: {'delta'}}."
            )
        out[name] = node  # a module, or None (no update)
    # a merge of LoRA states names a LoRALinear's module ".../query/lora" (its path name): each
    # name is read as the layer it spells; what is neither stays, for the mismatch message
    if layers and set(out) != set(layers):
        found, _ = _resolve(out, {n: lay.path for n, lay in layers.items()})
        renamed = {found.get(k, k): v for k, v in out.items()}
        if len(renamed) == len(out):
            return renamed
    return out


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in np.shape(x))


def apply_adapter(
    model: Any,
    merged: Any,
    *,
    mode: str = "fold",
    scale: float | Mapping[str, float] | None = None,
) -> Any:
    """A new model that computes the base model plus a merged adapter (the input is untouched).

    For each LoRA layer with base kernel ``W (d_in, d_out)`` and merged update
    ``dK = scale * lora_a @ lora_b`` (or ``delta``):

    * ``mode="fold"``: ``kernel <- W + dK`` (in the kernel's dtype) and ``lora_b <- 0``, so the
      forward is ``x @ (W + dK) + bias`` with the update counted exactly once. Needs a base kernel:
      an ``nnx.LoRALinear``, or an ``nnx.LoRA`` whose ``base_module`` has a ``kernel`` (d_in, d_out).
    * ``mode="lora"``: the base kernel is kept and the layer's ``lora_a``/``lora_b`` are replaced by
      new ``nnx.LoRAParam`` of the merged module's own rank ``K``: ``lora_a (d_in, K)`` and
      ``lora_b = merged_scale / layer_scale * merged_b (K, d_out)`` (the merged scale folded into
      ``lora_b``; ``layer_scale`` as in :func:`extract_adapter`), in the layer's factor dtypes.
      Dense modules (``{"delta"}``, from full-space TIES/DARE) have no factors and are refused.

    ``None`` at a module name means "no update" (a zero update in "fold", rank 0 in "lora").

    Args:
      model: an ``nnx.Module`` with LoRA layers.
      merged: the merged adapter from :func:`nu.merge_adapters` / :func:`nu.merge` on adapters
        from :func:`extract_adapter`: flat ``{name: module}`` or nested by path; its module names
        must be exactly the model's LoRA layers.
      mode: ``"fold"`` or ``"lora"``.
      scale: as for :func:`extract_adapter` (used by ``"lora"`` only).

    Returns:
      a new model (``nnx.clone``); unchanged variables share their arrays with ``model``.

    Raises:
      TypeError: ``model`` is not an ``nnx.Module``, ``merged`` is not a mapping.
      ValueError: unknown mode; merged names differ from the model's LoRA layers; a module whose
        ``(d_in, d_out)`` differs from its layer's; a dense module in ``"lora"`` mode; a layer
        without a base kernel in ``"fold"`` mode.

    Example:
      >>> from flax import nnx
      >>> import jax.numpy as jnp, numpy as np, netutility_jax as nu
      >>> model = nnx.LoRALinear(8, 4, lora_rank=2, rngs=nnx.Rngs(0))
      >>> merged = {"lora": {"lora_a": jnp.ones((8, 3)), "lora_b": jnp.ones((3, 4)), "scale": 0.5}}
      >>> folded = nu.nnx.apply_adapter(model, merged, mode="fold")
      >>> as_lora = nu.nnx.apply_adapter(model, merged, mode="lora")
      >>> as_lora.lora.lora_a.shape, model.lora.lora_a.shape
      ((8, 3), (8, 2))
      >>> x = jnp.ones((1, 8))
      >>> bool(np.allclose(folded(x), as_lora(x), atol=1e-5))
      True
    """
    fn = "nu.nnx.apply_adapter"
    if mode not in MODES:
        raise InputError(f"{fn}: unknown mode {mode!r}; expected one of {MODES}.")
    layers = _lora_layers(model, fn)
    mods = _merged_modules(fn, merged, layers)
    diff = _tree.name_mismatch(
        layers,
        mods,
        missing=lambda x: f"the model's LoRA layers {x[:3]} have no merged module",
        extra=lambda x: f"merged modules {x[:3]} are not LoRA layers of the model",
    )
    if diff:
        raise InputError(
            f"{fn}: merged module names do not match the model: {diff}. Merge "
            "adapters extracted from this model architecture (nu.nnx.extract_adapter); its "
            f"LoRA layers are {list(layers)[:5]}{' ...' if len(layers) > 5 else ''}."
        )
    scales = _scales(fn, layers, scale) if mode == "lora" else {}
    for name, layer in layers.items():
        _check(fn, name, layer, mods[name], mode, scales.get(name))
    new = nnx.clone(model)
    for name, layer in _lora_layers(new, fn).items():
        _apply_one(layer, mods[name], mode, scales.get(name))
    return new


def _layer_dims(layer: _Layer) -> tuple[int, int]:
    a, b = layer.lora.lora_a, layer.lora.lora_b
    return int(a.shape[0]), int(b.shape[1])


def _base_kernel(layer: _Layer) -> Any:
    kernel = getattr(layer.base, "kernel", None) if layer.base is not None else None
    return kernel if isinstance(kernel, nnx.Variable) else None


def _check(fn: str, name: str, layer: _Layer, mod: Any, mode: str, layer_scale: Any) -> None:
    d_in, d_out = _layer_dims(layer)
    ours = (
        f"the model's layer has (d_in, d_out) = ({d_in}, {d_out}) (lora_a "
        f"{tuple(layer.lora.lora_a.shape)}, lora_b {tuple(layer.lora.lora_b.shape)})"
    )
    if mod is not None:
        if "delta" in mod.keys():
            got, what = _shape(mod["delta"]), f"delta {_shape(mod['delta'])}"
            if len(got) != 2:
                got = (-1, -1)
        else:
            if "lora_a" not in mod.keys() or "lora_b" not in mod.keys():
                raise InputError(
                    f"{fn}: merged module {name!r} has keys {sorted(mod.keys())}; expected "
                    "'lora_a' and 'lora_b' (and 'scale'), or 'delta'."
                )
            sa, sb = _shape(mod["lora_a"]), _shape(mod["lora_b"])
            what = f"lora_a {sa}, lora_b {sb}"
            if len(sa) != 2 or len(sb) != 2 or sa[1] != sb[0]:
                raise InputError(
                    f"{fn}: merged module {name!r} has factors {what} that do not chain; expected "
                    "lora_a (d_in, K) and lora_b (K, d_out) in flax kernel layout."
                )
            got = (sa[0], sb[1])
        if got != (d_in, d_out):
            raise InputError(
                f"{fn}: merged module {name!r} ({what}) is not (d_in, d_out) = ({d_in}, {d_out}): "
                f"{ours}. Merge adapters extracted from this model (nu.nnx.extract_adapter)."
            )
    if mode == "fold":
        kernel = _base_kernel(layer)
        if kernel is None:
            raise InputError(
                f"{fn}: module {name!r} is an nnx.LoRA without a base kernel (base_module "
                f"{type(layer.base).__name__ if layer.base is not None else None}); mode='fold' "
                "adds the update to a base module's `kernel`. Use mode='lora' for this layer's "
                "model (and nu.to_lora for dense modules)."
            )
        if _shape(kernel) != (d_in, d_out):
            raise InputError(
                f"{fn}: module {name!r}: base kernel has shape {_shape(kernel)} but {ours}; "
                "mode='fold' needs a kernel in flax layout (d_in, d_out). Use mode='lora'."
            )
    else:
        if mod is not None and "delta" in mod.keys():
            raise InputError(
                f"{fn}: merged module {name!r} is dense ({{'delta': {_shape(mod['delta'])}}}, from "
                "a full-space TIES/DARE merge) and has no LoRA factors; use mode='fold' to add it "
                "to the base kernel, or truncate it first with nu.to_lora(module, rank)."
            )
        if not isinstance(layer_scale, jax.core.Tracer) and layer_scale == 0:
            raise InputError(
                f"{fn}: LoRA layer {name!r} has scale 0, so no lora_b reproduces the merged "
                "update; pass scale= or use mode='fold'."
            )


def _apply_one(layer: _Layer, mod: Any, mode: str, layer_scale: Any) -> None:
    lora = layer.lora
    a_var, b_var = lora.lora_a, lora.lora_b
    if mode == "fold":
        kernel = _base_kernel(layer)
        w = kernel.get_value()
        if mod is not None:
            w = w + module_update(mod).astype(w.dtype)
        kernel.set_value(w)
        b_var.set_value(jnp.zeros(b_var.shape, b_var.get_value().dtype))
        return
    a_dt, b_dt = a_var.get_value().dtype, b_var.get_value().dtype
    if mod is None:
        d_in, d_out = _layer_dims(layer)
        a, b = jnp.zeros((d_in, 0), a_dt), jnp.zeros((0, d_out), b_dt)
    else:
        a, b = jnp.asarray(mod["lora_a"]), jnp.asarray(mod["lora_b"])
        dt = _tree.float_dtype(b.dtype)
        factor = jnp.asarray(mod.get("scale", 1.0), dt) / jnp.asarray(layer_scale, dt)
        a, b = a.astype(a_dt), (factor * b.astype(dt)).astype(b_dt)
    lora.lora_a = a_var.replace(a)
    lora.lora_b = b_var.replace(b)
