"""The vision suite's data: the 7 datasets of the paper's Table 1, their class names, prompt
templates and readers.

**Datasets** (:data:`DATASETS`, in the paper's order :data:`ORDER`): DTD, EuroSAT, GTSRB, MNIST,
RESISC45, SUN397, SVHN, with the class names and CLIP prompt templates of the KnOTS code
(``dataset/*.py``, ``dataset/templates.py``; the templates are task-vectors' and CLIP's), written
out here. SUN397's 397 class names come from the data itself (:func:`class_name`): its class
folders (``a/abbey`` or KnOTS' flattened ``a_abbey`` -> ``"abbey"``, ``a/apartment_building/
outdoor`` -> ``"apartment building outdoor"``, KnOTS' rule ``folder[2:].replace("_", " ")``) or
the ``ClassLabel`` names of a parquet file. Any other dataset name is a dataset of your own: its
classes come from the data and its template is ``"a photo of a {c}."``. A dataset folder may
override both with ``classnames.txt`` (one name per line, in label order) and
``templates.txt`` (one template per line, ``{c}`` standing for the class name).

**Layouts** read (``DATA`` is ``--data-dir``; the dataset folder's name is matched without case,
``DATA/EuroSAT`` is eurosat's):

* an image-folder tree, ``DATA/<dataset>/<split>/<class>/*.jpg`` (``.jpeg .png .ppm .bmp .pgm
  .tif .tiff .webp``, any case; what torchvision's ``ImageFolder`` and the KnOTS code read). A
  class is every folder that directly holds images, named by its path below the split folder
  (so SUN397's original nested ``a/apartment_building/outdoor`` works); classes are sorted by
  that path with ``/`` read as ``_`` and labelled 0, 1, ... in that order (``ImageFolder``'s
  rule for flat trees; KnOTS' order for SUN397); images are in sorted order within a class.
* a Hugging Face dataset saved as parquet files, ``DATA/<dataset>/<split>-*.parquet`` or
  ``<split>.parquet``, also under ``DATA/<dataset>/data/`` (a hub repository's layout): an image
  column (``image`` or ``img``, the ``datasets`` Image feature: a struct with ``bytes``) and an
  integer label column (``label`` or ``labels``); rows are read in file-name order. Reading
  parquet needs ``pyarrow`` (``pip install pyarrow``), imported only when a parquet split is read.

Split folder and file names: ``train`` (or ``training``), ``val`` (``validation``, ``valid``),
``test`` (``testing``).

The datasets split for the suite (validation as KnOTS, index files, sizes) are
:mod:`vision_tasks`'s (``vision_tasks.load_task``); the images decoded and preprocessed,
:mod:`vision_images`'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ...errors import InputError, MissingFileError

__all__ = [
    "DATASETS",
    "DEFAULT_TEMPLATES",
    "IMAGE_EXTENSIONS",
    "ORDER",
    "SPLIT_NAMES",
    "DatasetSpec",
    "ImageRef",
    "Split",
    "VisionDataError",
    "class_name",
    "dataset_dir",
    "dataset_spec",
    "find_split",
    "parquet_columns",
    "parquet_reader",
    "read_split",
]

#: Image file endings of an image-folder tree (torchvision's ``IMG_EXTENSIONS``), any case.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
#: The template of a dataset of your own (and CLIP's most common one).
DEFAULT_TEMPLATES = ("a photo of a {c}.",)
_SPLITS = {
    "train": ("train", "training"),
    "val": ("val", "validation", "valid"),
    "test": ("test", "testing"),
}
#: The splits :func:`find_split` looks for, each under its folder and file names.
SPLIT_NAMES = tuple(_SPLITS)
_PYARROW = "reading parquet needs pyarrow: pip install pyarrow"


class VisionDataError(InputError):
    """A dataset folder the vision suite cannot read (the message names the path and the fix)."""


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """A dataset of the vision suite.

    Attributes:
      name: the task's name (``dtd``); its folder is ``DATA/<name>`` (case ignored).
      classes: the class names in label order, or None: from the data (:func:`class_name`).
      templates: CLIP prompt templates, ``{c}`` standing for the class name.
      source: where the names and templates come from.
    """

    name: str
    classes: tuple[str, ...] | None
    templates: tuple[str, ...]
    source: str = "KnOTS dataset/*.py and dataset/templates.py"


_DTD = (
    "banded blotchy braided bubbly bumpy chequered cobwebbed cracked crosshatched crystalline "
    "dotted fibrous flecked freckled frilly gauzy grid grooved honeycombed interlaced knitted "
    "lacelike lined marbled matted meshed paisley perforated pitted pleated polka-dotted porous "
    "potholed scaly smeared spiralled sprinkled stained stratified striped studded swirly veined "
    "waffled woven wrinkled zigzagged"
).split()
# EuroSAT's folders (AnnualCrop, Forest, ..., SeaLake, sorted) renamed as KnOTS and CLIP do
_EUROSAT = (
    "annual crop land", "forest", "brushland or shrubland", "highway or road",
    "industrial buildings or commercial buildings", "pasture land", "permanent crop land",
    "residential buildings or homes or apartments", "river", "lake or sea",
)  # fmt: skip
_GTSRB = (
    "red and white circle 20 kph speed limit",
    "red and white circle 30 kph speed limit",
    "red and white circle 50 kph speed limit",
    "red and white circle 60 kph speed limit",
    "red and white circle 70 kph speed limit",
    "red and white circle 80 kph speed limit",
    "end / de-restriction of 80 kph speed limit",
    "red and white circle 100 kph speed limit",
    "red and white circle 120 kph speed limit",
    "red and white circle red car and black car no passing",
    "red and white circle red truck and black car no passing",
    "red and white triangle road intersection warning",
    "white and yellow diamond priority road",
    "red and white upside down triangle yield right-of-way",
    "stop",
    "empty red and white circle",
    "red and white circle no truck entry",
    "red circle with white horizonal stripe no entry",
    "red and white triangle with exclamation mark warning",
    "red and white triangle with black left curve approaching warning",
    "red and white triangle with black right curve approaching warning",
    "red and white triangle with black double curve approaching warning",
    "red and white triangle rough / bumpy road warning",
    "red and white triangle car skidding / slipping warning",
    "red and white triangle with merging / narrow lanes warning",
    "red and white triangle with person digging / construction / road work warning",
    "red and white triangle with traffic light approaching warning",
    "red and white triangle with person walking warning",
    "red and white triangle with child and person walking warning",
    "red and white triangle with bicyle warning",
    "red and white triangle with snowflake / ice warning",
    "red and white triangle with deer warning",
    "white circle with gray strike bar no speed limit",
    "blue circle with white right turn arrow mandatory",
    "blue circle with white left turn arrow mandatory",
    "blue circle with white forward arrow mandatory",
    "blue circle with white forward or right turn arrow mandatory",
    "blue circle with white forward or left turn arrow mandatory",
    "blue circle with white keep right arrow mandatory",
    "blue circle with white keep left arrow mandatory",
    "blue circle with white arrows indicating a traffic circle",
    "white circle with gray strike bar indicating no passing for cars has ended",
    "white circle with gray strike bar indicating no passing for trucks has ended",
)
_RESISC45 = tuple(
    c.replace("_", " ")
    for c in (
        "airplane airport baseball_diamond basketball_court beach bridge chaparral church "
        "circular_farmland cloud commercial_area dense_residential desert forest freeway "
        "golf_course ground_track_field harbor industrial_area intersection island lake meadow "
        "medium_residential mobile_home_park mountain overpass palace parking_lot railway "
        "railway_station rectangular_farmland river roundabout runway sea_ice ship snowberg "
        "sparse_residential stadium storage_tank tennis_court terrace thermal_power_station "
        "wetland"
    ).split()
)
_DIGITS = tuple(str(i) for i in range(10))


def _templates(*prefixes: str, suffix: str = "") -> tuple[str, ...]:
    return tuple(f"{p}{{c}}{suffix}" for p in prefixes)


#: The paper's 7 datasets (Table 1), by name.
DATASETS: dict[str, DatasetSpec] = {
    s.name: s
    for s in (
        DatasetSpec(
            "dtd",
            tuple(_DTD),
            tuple(
                f"a photo of {art} {{c}} {what}."
                for art in ("a", "the")
                for what in ("texture", "pattern", "thing", "object")
            ),
        ),
        DatasetSpec(
            "eurosat",
            _EUROSAT,
            _templates(
                "a centered satellite photo of ",
                "a centered satellite photo of a ",
                "a centered satellite photo of the ",
                suffix=".",
            ),
        ),
        DatasetSpec(
            "gtsrb",
            _GTSRB,
            tuple(
                f'a {how} photo of a "{{c}}" traffic sign.'
                for how in ("zoomed in", "centered", "close up")
            ),
        ),
        DatasetSpec("mnist", _DIGITS, ('a photo of the number: "{c}".',)),
        DatasetSpec(
            "resisc45",
            _RESISC45,
            tuple(
                f"{src} {kind} of {art}{{c}}."
                for art in ("", "a ", "the ")
                for kind in ("imagery", "photo", "view")
                for src in ("satellite", "aerial")
            ),
        ),
        DatasetSpec("sun397", None, _templates("a photo of a ", "a photo of the ", suffix=".")),
        DatasetSpec("svhn", _DIGITS, ('a photo of the number: "{c}".',)),
    )
}
#: The paper's order of the datasets (the order bare ``--adapters`` folders are matched in).
ORDER = tuple(DATASETS)


def dataset_spec(name: str) -> DatasetSpec:
    """The spec of ``name``: a built-in one, or a dataset of your own (classes from the data,
    :data:`DEFAULT_TEMPLATES`)."""
    if name in DATASETS:
        return DATASETS[name]
    return DatasetSpec(name, None, DEFAULT_TEMPLATES, source="your own dataset")


# ---------------------------------------------------------------------------------- folders


def dataset_dir(data_dir: str | os.PathLike, name: str) -> pathlib.Path:
    """``DATA/<name>``, matched without case (``DATA/EuroSAT`` for ``eurosat``).

    Raises:
      MissingFileError: no such folder (the message lists the folders there).
    """
    root = pathlib.Path(data_dir)
    exact = root / name
    if exact.is_dir():
        return exact
    try:
        found = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError as e:
        raise MissingFileError(f"--data-dir {root}: cannot list it ({e.strerror or e})") from None
    for p in found:
        if p.name.lower() == name.lower():
            return p
    have = ", ".join(p.name for p in found[:12]) or "none"
    raise MissingFileError(
        f"--data-dir {root}: no folder for dataset {name!r} (expected {root / name}; folders "
        f"there: {have})"
    )


class _Found(NamedTuple):
    kind: str  # "folder" or "parquet"
    paths: tuple[pathlib.Path, ...]


def find_split(ds_dir: pathlib.Path, split: str) -> _Found | None:
    """Where split ``split`` (``train``, ``val``, ``test``) of a dataset folder is: an image
    folder ``<ds_dir>/<split>/`` or parquet files ``<split>-*.parquet`` / ``<split>.parquet``
    (also under ``data/``); None if there is neither."""
    for alias in _SPLITS[split]:
        for base in (ds_dir, ds_dir / "data"):
            if not base.is_dir():
                continue
            files = sorted(
                p
                for p in base.iterdir()
                if p.is_file()
                and p.suffix.lower() == ".parquet"
                and (p.stem.lower() == alias or p.stem.lower().startswith(alias + "-"))
            )
            if files:
                return _Found("parquet", tuple(files))
        for p in sorted(ds_dir.iterdir()) if ds_dir.is_dir() else ():
            if p.is_dir() and p.name.lower() == alias:
                return _Found("folder", (p,))
    return None


# ------------------------------------------------------------------------------ class names


def class_name(key: str, *, flat_index: bool = False) -> str:
    """A class's name from its folder path (or a ``ClassLabel`` name) below the split, by KnOTS'
    SUN397 rule: the one-letter index folder dropped (``a/abbey``; with ``flat_index``, also
    KnOTS' flattened ``a_abbey``, SUN397's layout), ``_`` and ``/`` read as spaces.

    Example:
      >>> [class_name(k) for k in ("a/abbey", "/b/bakery/shop", "banded", "t_shirt")]
      ['abbey', 'bakery shop', 'banded', 't shirt']
      >>> class_name("a_apartment_building_outdoor", flat_index=True)
      'apartment building outdoor'
    """
    parts = key.strip("/").split("/")
    if len(parts) > 1 and re.fullmatch(r"[a-z]", parts[0]):
        parts = parts[1:]
    k = "_".join(parts)
    if flat_index and len(parts) == 1 and re.fullmatch(r"[a-z]_.+", k):
        k = k[2:]
    return k.replace("_", " ").strip()


# ---------------------------------------------------------------------------------- splits


class ImageRef(NamedTuple):
    """Where one image is: a file (``row`` -1) or row ``row`` of a parquet file."""

    path: str
    row: int = -1


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
    """The examples of one split: ``refs`` (:class:`ImageRef`) and ``labels`` ``(N,)`` int32.

    ``classes``: the class keys the data names (image folders: folder paths; parquet:
    ``ClassLabel`` names), or None.
    """

    refs: tuple[ImageRef, ...]
    labels: np.ndarray
    classes: tuple[str, ...] | None = None

    def __len__(self) -> int:
        return len(self.refs)

    def take(self, index: Sequence[int] | np.ndarray) -> Split:
        """The examples at ``index``, in that order."""
        idx = np.asarray(index, np.int64)
        return Split(tuple(self.refs[i] for i in idx), self.labels[idx].copy(), self.classes)


def _image_folder(folder: pathlib.Path) -> Split:
    """The examples of an image-folder split (see the module doc for the rules)."""
    per_class: dict[str, list[str]] = {}
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs.sort()
        images = sorted(f for f in files if f.lower().endswith(IMAGE_EXTENSIONS))
        if images:
            rel = pathlib.Path(root).relative_to(folder).as_posix()
            if rel == ".":
                raise VisionDataError(
                    f"{folder}: images lie directly in the split folder; put each class's "
                    f"images in a folder of its own ({folder}/<class>/*.jpg)"
                )
            per_class[rel] = [os.path.join(root, f) for f in images]
    if not per_class:
        raise VisionDataError(
            f"{folder}: no images found (expected {folder}/<class>/*.jpg, .png, ...)"
        )
    keys = sorted(per_class, key=lambda k: k.replace("/", "_"))
    refs, labels = [], []
    for i, k in enumerate(keys):
        refs += [ImageRef(p) for p in per_class[k]]
        labels += [i] * len(per_class[k])
    return Split(tuple(refs), np.asarray(labels, np.int32), tuple(keys))


def parquet_reader() -> Any:
    """``pyarrow.parquet``, or a :class:`VisionDataError` saying how to install it."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise VisionDataError(_PYARROW) from None
    return pq


def parquet_columns(schema: Any, f: pathlib.Path) -> tuple[str, str]:
    """The image and label columns of a parquet file's schema (``f`` names it in messages)."""
    names = list(schema.names)
    image = next((n for n in ("image", "img") if n in names), None)
    label = next((n for n in ("label", "labels") if n in names), None)
    if image is None or label is None:
        raise VisionDataError(
            f"{f}: columns {names}; expected an image column ('image' or 'img', the datasets "
            "Image feature) and an integer label column ('label' or 'labels')"
        )
    return image, label


def _label_names(schema: Any, label: str) -> tuple[str, ...] | None:
    """The ``ClassLabel`` names a Hugging Face parquet file records in its schema metadata."""
    meta = schema.metadata or {}
    raw = meta.get(b"huggingface")
    if raw is None:
        return None
    try:
        feats = json.loads(raw)["info"]["features"]
        names = feats[label].get("names")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return tuple(str(n) for n in names) if isinstance(names, list) and names else None


def _parquet(files: Sequence[pathlib.Path]) -> Split:
    pq = parquet_reader()
    refs: list[ImageRef] = []
    labels: list[np.ndarray] = []
    classes = None
    for f in files:
        try:
            pf = pq.ParquetFile(f)
            schema = pf.schema_arrow
            _, label = parquet_columns(schema, f)
            col = pf.read(columns=[label]).column(0)
        except VisionDataError:
            raise
        except Exception as e:  # pyarrow's own errors (corrupt file, ...)
            raise VisionDataError(f"{f}: cannot read it as parquet ({e})") from None
        if col.null_count:
            raise VisionDataError(f"{f}: {col.null_count} row(s) have no {label!r}")
        lab = np.asarray(col.to_numpy(zero_copy_only=False))
        if not np.issubdtype(lab.dtype, np.integer):
            raise VisionDataError(
                f"{f}: column {label!r} holds {lab.dtype} values; expected integer class ids"
            )
        classes = classes or _label_names(schema, label)
        refs += [ImageRef(str(f), i) for i in range(len(lab))]
        labels.append(lab.astype(np.int64))
    lab = np.concatenate(labels) if labels else np.zeros(0, np.int64)
    if len(lab) and (lab.min() < 0 or (classes is not None and lab.max() >= len(classes))):
        raise VisionDataError(
            f"{files[0].parent}: labels run from {lab.min()} to {lab.max()}"
            + (f" but the files name {len(classes)} classes" if classes else "")
        )
    return Split(tuple(refs), lab.astype(np.int32), classes)


def read_split(found: _Found) -> Split:
    """The examples of a split :func:`find_split` found (no image is decoded)."""
    return _image_folder(found.paths[0]) if found.kind == "folder" else _parquet(found.paths)
