"""CLIP's image preprocessing, identical to transformers' ``CLIPImageProcessor`` (PIL backend).

Per image: convert to RGB (transparency composited onto white, as transformers 5.24 does;
``alpha="drop"`` for the plain ``convert("RGB")`` of transformers 5.17 and earlier), resize with
PIL so that the shortest side is ``shortest_edge`` (bicubic for CLIP; the long side is
``int(shortest_edge * long / short)``), center crop to ``crop_size`` (zero padding where the
image is smaller), rescale by ``1/255`` (in float64, then float32), normalize
``(x - mean) / std`` in float32. The output is ``(N, 3, H, W)`` float32, channels first, what
:meth:`CLIPModel.get_image_features` takes. Every step is the one of transformers' PIL backend,
so the arrays are equal, not only close.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...errors import InputError, InputTypeError
from .llama_tokenizer import read_json

__all__ = [
    "ALPHA_MODES",
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "ImageProcessorConfig",
    "preprocess",
]

ALPHA_MODES = ("white", "drop")
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC


@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
    """The settings of a ``preprocessor_config.json`` (the defaults are CLIP's).

    Attributes:
      do_convert_rgb: convert to RGB first.
      alpha: how that conversion treats transparency: ``"white"`` composites the image onto a
        white background (transformers 5.24's ``convert_to_rgb``), ``"drop"`` discards the
        alpha channel (PIL's ``convert("RGB")``, what transformers 5.17 and earlier do). Not a
        field of ``preprocessor_config.json``: pick the transformers whose outputs you must
        match. Opaque images are the same either way.
      do_resize: resize before cropping.
      size: an int: the shortest side becomes ``size`` (``{"shortest_edge": n}``); a pair:
        resize to exactly ``(height, width)``.
      resample: PIL's filter number (3 bicubic, 2 bilinear, 0 nearest, 1 Lanczos, 4 box,
        5 Hamming).
      do_center_crop: crop the center ``crop_size`` ``(height, width)``.
      crop_size: ``(height, width)`` of the crop.
      do_rescale: multiply by ``rescale_factor``.
      rescale_factor: ``1/255`` maps bytes to ``[0, 1]``.
      do_normalize: ``(x - image_mean) / image_std`` per channel.
      image_mean, image_std: per channel (OpenAI's CLIP statistics).
    """

    do_convert_rgb: bool = True
    alpha: str = "white"
    do_resize: bool = True
    size: int | tuple[int, int] = 224
    resample: int = _BICUBIC
    do_center_crop: bool = True
    crop_size: tuple[int, int] = (224, 224)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD

    def __post_init__(self):
        fn = "ImageProcessorConfig"
        for name in ("do_convert_rgb", "do_resize", "do_center_crop", "do_rescale", "do_normalize"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{fn}: {name}={getattr(self, name)!r}; expected true or false.")
        if self.alpha not in ALPHA_MODES:
            raise InputError(f"{fn}: alpha={self.alpha!r}; expected one of {ALPHA_MODES}.")
        size = self.size
        if isinstance(size, Sequence):
            object.__setattr__(self, "size", _pair(fn, "size", size))
        elif not _is_pos_int(size):
            raise InputError(
                f"{fn}: size={size!r}; expected a positive int (the shortest side) or a "
                "(height, width) pair."
            )
        object.__setattr__(self, "crop_size", _pair(fn, "crop_size", self.crop_size))
        r = self.resample
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r not in range(6):
            raise InputError(
                f"{fn}: resample={self.resample!r}; expected a PIL filter number 0..5 (3 is "
                "bicubic)."
            )
        object.__setattr__(self, "resample", int(self.resample))  # PIL's IntEnum -> int
        r = self.rescale_factor
        if (
            isinstance(r, bool)
            or not isinstance(r, (int, float))
            or not (math.isfinite(r) and r > 0)
        ):
            raise InputError(f"{fn}: rescale_factor={r!r}; expected a positive number (1/255).")
        for name in ("image_mean", "image_std"):
            v = getattr(self, name)
            v = (v,) * 3 if isinstance(v, (int, float)) and not isinstance(v, bool) else v
            ok = isinstance(v, Sequence) and len(v) == 3
            ok = ok and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
            if not ok or (name == "image_std" and not all(x > 0 for x in v)):
                raise InputError(
                    f"{fn}: {name}={v!r}; expected 3 numbers (R, G, B)"
                    f"{', all positive' if name == 'image_std' else ''}."
                )
            object.__setattr__(self, name, tuple(float(x) for x in v))

    @classmethod
    def from_hf(
        cls, c: Mapping[str, Any], *, source: str = "preprocessor_config.json"
    ) -> ImageProcessorConfig:
        """The settings of a Hugging Face ``preprocessor_config.json``.

        ``size`` may be an int (old files: the shortest side), ``{"shortest_edge": n}`` or
        ``{"height", "width"}``; ``crop_size`` an int or ``{"height", "width"}``. Fields left
        out take ``CLIPImageProcessor``'s defaults.

        Raises:
          InputError: a field of the wrong type or value (named), a ``size`` with
            ``longest_edge`` or other keys this port does not implement.
        """
        fn = f"ImageProcessorConfig.from_hf({source})"
        if not isinstance(c, Mapping):
            raise InputError(f"{fn}: the file holds a {type(c).__name__}; expected a JSON object.")
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name != "alpha" and c.get(f.name) is not None:
                kw[f.name] = c[f.name]
        if "size" in kw:
            kw["size"] = _hf_size(fn, kw["size"])
        if "crop_size" in kw:
            cs = kw["crop_size"]
            kw["crop_size"] = (cs, cs) if _is_pos_int(cs) else _hf_hw(fn, "crop_size", cs)
        try:
            return cls(**kw)
        except InputError as e:
            raise InputError(f"{fn}: {str(e).split(': ', 1)[1]}") from None

    @classmethod
    def from_pretrained(cls, folder: str | pathlib.Path) -> ImageProcessorConfig:
        """The folder's ``preprocessor_config.json``, or CLIP's defaults if it has none."""
        f = pathlib.Path(folder) / "preprocessor_config.json"
        if not f.is_file():
            return cls()
        fn = f"ImageProcessorConfig.from_pretrained({str(folder)!r})"
        return cls.from_hf(read_json(f, fn), source=str(f))


def _is_pos_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0


def _pair(fn: str, name: str, v: Any) -> tuple[int, int]:
    if not (isinstance(v, Sequence) and len(v) == 2 and all(_is_pos_int(x) for x in v)):
        raise InputError(f"{fn}: {name}={v!r}; expected a (height, width) pair of positive ints.")
    return int(v[0]), int(v[1])


def _hf_hw(fn: str, name: str, v: Any) -> tuple[int, int]:
    if isinstance(v, Mapping):
        if set(v) != {"height", "width"}:
            raise InputError(
                f"{fn}: {name}={dict(v)!r}; expected an int or {{'height', 'width'}}"
                f"{' or {shortest_edge}' if name == 'size' else ''}."
            )
        return _pair(fn, name, (v["height"], v["width"]))
    return _pair(fn, name, v)


def _hf_size(fn: str, v: Any) -> int | tuple[int, int]:
    if _is_pos_int(v):
        return int(v)
    if isinstance(v, Mapping) and "shortest_edge" in v:
        if set(v) != {"shortest_edge"}:
            raise InputError(
                f"{fn}: size={dict(v)!r}; only {{'shortest_edge'}} or {{'height', 'width'}} are "
                "implemented (no 'longest_edge')."
            )
        if not _is_pos_int(v["shortest_edge"]):
            raise InputError(
                f"{fn}: size.shortest_edge={v['shortest_edge']!r}; expected a positive int."
            )
        return int(v["shortest_edge"])
    return _hf_hw(fn, "size", v)


# ------------------------------------------------------------------------------ the steps


def _as_pil(fn: str, i: int, image: Any) -> Any:
    from PIL import Image

    if isinstance(image, Image.Image):
        return image
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or not (
            image.ndim == 2 or (image.ndim == 3 and image.shape[-1] in (3, 4))
        ):
            raise InputError(
                f"{fn}: image {i} is a {image.dtype} array of shape {image.shape}; expected a "
                "PIL image or a uint8 array (H, W), (H, W, 3) or (H, W, 4)."
            )
        return Image.fromarray(image)
    raise InputTypeError(
        f"{fn}: image {i} is a {type(image).__name__}; expected a PIL image or a uint8 array."
    )


def _to_rgb(image: Any, alpha: str) -> np.ndarray:
    """transformers' ``convert_to_rgb``: ``(H, W, 3)`` uint8, transparency over white (or
    dropped)."""
    from PIL import Image

    transparent = "A" in image.getbands() or image.info.get("transparency") is not None
    if alpha == "white" and transparent:
        image = image.convert("RGBA")
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return np.array(Image.alpha_composite(white, image).convert("RGB"))
    return np.array(image.convert("RGB"))


def _resize(chw: np.ndarray, size: int | tuple[int, int], resample: int) -> np.ndarray:
    """transformers' PIL ``resize`` of a ``(C, H, W)`` uint8 image."""
    from PIL import Image

    _, h, w = chw.shape
    if isinstance(size, int):  # the shortest side becomes `size`
        short, long = (w, h) if w <= h else (h, w)
        new_long = int(size * long / short)
        new_h, new_w = (new_long, size) if w <= h else (size, new_long)
    else:
        new_h, new_w = size
    hwc = np.moveaxis(chw, 0, -1)
    hwc = hwc[..., 0] if hwc.shape[-1] == 1 else hwc
    out = np.array(Image.fromarray(hwc).resize((new_w, new_h), resample=resample))
    out = out[..., None] if out.ndim == 2 else out
    return np.moveaxis(out, -1, 0)


def _center_crop(chw: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """transformers' ``center_crop``: the central ``size``, zero-padded where the image is
    smaller (the padding split ``ceil`` before, ``floor`` after)."""
    _, h, w = chw.shape
    ch, cw = size
    top, left = (h - ch) // 2, (w - cw) // 2
    if top >= 0 and left >= 0 and top + ch <= h and left + cw <= w:
        return chw[:, top : top + ch, left : left + cw]
    nh, nw = max(ch, h), max(cw, w)
    pad_t, pad_l = math.ceil((nh - h) / 2), math.ceil((nw - w) / 2)
    canvas = np.zeros_like(chw, shape=(chw.shape[0], nh, nw))
    canvas[:, pad_t : pad_t + h, pad_l : pad_l + w] = chw
    top, left = top + pad_t, left + pad_l
    return canvas[:, max(0, top) : min(nh, top + ch), max(0, left) : min(nw, left + cw)]


def _one(fn: str, i: int, image: Any, cfg: ImageProcessorConfig) -> np.ndarray:
    pil = _as_pil(fn, i, image)
    if cfg.do_convert_rgb:
        chw = np.moveaxis(_to_rgb(pil, cfg.alpha), -1, 0)
    else:
        arr = np.array(pil)
        if arr.dtype != np.uint8:
            raise InputError(
                f"{fn}: image {i} has PIL mode {pil.mode!r} ({arr.dtype} pixels); expected 8-bit "
                "pixels, or do_convert_rgb=True."
            )
        chw = arr[None] if arr.ndim == 2 else np.moveaxis(arr, -1, 0)
    if cfg.do_resize:
        chw = _resize(chw, cfg.size, cfg.resample)
    if cfg.do_center_crop:
        chw = _center_crop(chw, cfg.crop_size)
    x: np.ndarray = chw
    if cfg.do_rescale:
        x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    if cfg.do_normalize:
        x = x if np.issubdtype(x.dtype, np.floating) else x.astype(np.float32)
        if x.shape[0] != 3:
            raise InputError(
                f"{fn}: image {i} has {x.shape[0]} channel(s) but image_mean/image_std have 3; "
                "use do_convert_rgb=True."
            )
        mean = np.asarray(cfg.image_mean, x.dtype)[:, None, None]
        std = np.asarray(cfg.image_std, x.dtype)[:, None, None]
        x = (x - mean) / std
    return x


def preprocess(images: Any, config: ImageProcessorConfig | None = None) -> np.ndarray:
    """Pixel values ``(N, C, H, W)`` float32 of images, as ``CLIPImageProcessor`` computes them.

    The steps (see the module docstring) are transformers' PIL backend, exactly: the same PIL
    resize, the same float64 rescale and float32 normalization, so the arrays are equal.

    Args:
      images: a PIL image, a uint8 array ``(H, W)`` / ``(H, W, 3|4)`` (converted with
        ``PIL.Image.fromarray``), or a sequence of them.
      config: the settings (:meth:`ImageProcessorConfig.from_pretrained` reads a folder's
        ``preprocessor_config.json``); default CLIP's (224 bicubic, center crop 224).

    Returns:
      ``(N, C, H, W)`` float32 numpy (``C = 3`` with ``do_convert_rgb``).

    Raises:
      InputError: no image; images of different sizes after the steps (no resize or crop);
        an array that is not uint8 ``(H, W[, 3|4])``.
      InputTypeError: an item that is neither a PIL image nor an array.

    Example:
      >>> import numpy as np
      >>> from PIL import Image
      >>> from netutility_jax.experiments.models import clip
      >>> img = Image.fromarray(np.full((30, 50, 3), 255, np.uint8))
      >>> cfg = clip.ImageProcessorConfig(size=16, crop_size=(16, 16))
      >>> x = clip.preprocess([img, img.convert("L")], cfg)
      >>> x.shape, x.dtype
      ((2, 3, 16, 16), dtype('float32'))
      >>> bool(np.allclose(x[:, 0], (1 - 0.48145466) / 0.26862954))
      True
    """
    fn = "clip.preprocess"
    cfg = ImageProcessorConfig() if config is None else config
    if not isinstance(cfg, ImageProcessorConfig):
        raise InputTypeError(
            f"{fn}: config is a {type(cfg).__name__}; expected a clip.ImageProcessorConfig."
        )
    if not isinstance(images, (list, tuple)):
        images = [images]
    if not images:
        raise InputError(f"{fn}: no images given; pass at least one.")
    out = [_one(fn, i, im, cfg) for i, im in enumerate(images)]
    shapes = sorted({x.shape for x in out})
    if len(shapes) > 1:
        raise InputError(
            f"{fn}: the images end with different shapes {shapes[:3]}; batching needs one size "
            "(turn on do_center_crop, or resize to a (height, width) pair)."
        )
    return np.stack(out).astype(np.float32, copy=False)
