"""The vision suite's images: decoded and preprocessed as CLIP's processor does, up to the crop.

:func:`load_images` reads the images of a :class:`vision_data.Split` (image files, or the bytes
of parquet cells, each parquet file read once) and preprocesses them (``clip.preprocess``) in
threads, to ``uint8`` arrays; rescaling and normalizing run on the device.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .vision_data import ImageRef, Split, VisionDataError, parquet_columns, parquet_reader

__all__ = ["load_images"]


class _Source(NamedTuple):
    """One image to decode: a file path, or the bytes of a parquet cell; ``where`` names it."""

    data: str | bytes
    where: str


def _sources(refs: Sequence[ImageRef]) -> Iterable[tuple[int, _Source]]:
    """``(position, source)`` of every ref, each parquet file read once, in batches of rows."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for i, r in enumerate(refs):
        if r.row < 0:
            yield i, _Source(r.path, r.path)
        else:
            by_file.setdefault(r.path, []).append((r.row, i))
    for path, wanted in by_file.items():
        pq = parquet_reader()
        pf = pq.ParquetFile(path)
        image, _ = parquet_columns(pf.schema_arrow, pathlib.Path(path))
        rows = dict(wanted)
        offset = 0
        for batch in pf.iter_batches(batch_size=256, columns=[image]):
            col = batch.column(0)
            for j in range(len(col)):
                pos = rows.get(offset + j)
                if pos is None:
                    continue
                cell = col[j].as_py()
                data = cell.get("bytes") if isinstance(cell, Mapping) else cell
                if not isinstance(data, (bytes, bytearray)):
                    raise VisionDataError(
                        f"{path}: row {offset + j} has no image bytes (column {image!r}); save "
                        "the dataset with its images embedded"
                    )
                yield pos, _Source(bytes(data), f"{path} row {offset + j}")
            offset += len(col)


def _preprocessed(src: _Source, cfg: Any) -> np.ndarray:
    """One image decoded and preprocessed (``clip.preprocess``), ``(3, H, W)`` uint8."""
    from PIL import Image, UnidentifiedImageError

    from ..models import clip

    try:
        with Image.open(src.data if isinstance(src.data, str) else io.BytesIO(src.data)) as im:
            im.load()
            return clip.preprocess(im, cfg)[0].astype(np.uint8)
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as e:
        raise VisionDataError(f"{src.where}: cannot decode the image ({e})") from None


def load_images(split: Split, config: Any, *, workers: int | None = None) -> np.ndarray:
    """The images of ``split`` preprocessed to ``(N, 3, H, W)`` uint8: CLIP's preprocessing
    (``clip.preprocess`` with ``config``) up to the crop, before rescaling and normalizing
    (those run on the device, exactly as ``clip.preprocess`` computes them). Images are decoded
    and resized in ``workers`` threads (PIL releases the GIL; default: the CPUs, at most 16).

    Raises:
      VisionDataError: an image that cannot be decoded; parquet without pyarrow; no images.
    """
    from concurrent.futures import ThreadPoolExecutor

    if not len(split):
        raise VisionDataError("load_images: the split holds no images")
    cfg = dataclasses.replace(config, do_rescale=False, do_normalize=False)
    workers = workers or min(16, os.cpu_count() or 1)
    out: np.ndarray | None = None
    chunk: list[tuple[int, _Source]] = []

    def flush(pool: ThreadPoolExecutor) -> None:
        nonlocal out
        for (pos, _), x in zip(
            chunk, pool.map(lambda c: _preprocessed(c[1], cfg), chunk), strict=True
        ):
            if out is None:
                out = np.zeros((len(split), *x.shape), np.uint8)
            if x.shape != out.shape[1:]:
                raise VisionDataError(
                    f"load_images: images of shapes {out.shape[1:]} and {x.shape} after "
                    "preprocessing; preprocessor_config.json must crop to one size"
                )
            out[pos] = x
        chunk.clear()

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for item in _sources(split.refs):
            chunk.append(item)
            if len(chunk) >= 64 * workers:
                flush(pool)
        flush(pool)
    return out  # type: ignore[return-value]  # (the split is not empty: set above)
