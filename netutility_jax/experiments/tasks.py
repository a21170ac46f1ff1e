"""Text classification tasks for the LoRA-merging experiment, from real labelled data.

The machines this project runs on reach no network but the package registries, so
every built-in task is built from data that Debian packages ship. Install them with
(as root; R itself comes along as a dependency, but is never run)::

    apt-get install -y --no-install-recommends r-cran-dslabs r-cran-janeaustenr \\
        r-cran-modeldata r-cran-tidytext wordnet-base

The R packages keep their data sets in R lazy-load databases
(``<R library>/<package>/data/Rdata.rdx`` + ``Rdata.rdb``). This module reads them
with a small reader of R's XDR serialization format written here: it only decodes
vectors, lists and attributes (no code is ever evaluated and nothing is unpickled),
and is several times faster than a general-purpose parser (0.7 s instead of 4 s for
the 208k-row ``parts_of_speech`` table). The WordNet task reads ``/usr/share/wordnet/data.noun``.

Built-in tasks (sizes for the defaults ``max_train=2000, n_val=200, n_test=1000``)
======================================================================================

Every task also has one short description per label (``TaskInfo.label_texts``): the base
model's embeddings of these are the task's frozen zero-shot head in the built-in experiment.

==================  =============================================  ===============================================  ==========================================  ==================
name                source (Debian package: file, object)          text                                             labels                                      train / val / test
==================  =============================================  ===============================================  ==========================================  ==================
austen_novel        r-cran-janeaustenr: data/Rdata.rdb, objects    a passage of two consecutive lines from one      Emma, Mansfield Park, Northanger Abbey,     1998 / 204 / 1002
                    emma, mansfieldpark, northangerabbey,          paragraph of a novel (passages of >= 8 words)    Persuasion, Pride and Prejudice, Sense
                    persuasion, prideprejudice, sensesensibility                                                    and Sensibility
tweet_source        r-cran-dslabs: data/Rdata.rdb, trump_tweets    a tweet from @realDonaldTrump, 2015-06-16 to     Android, iPhone                             2000 / 200 / 1000
                                                                   2016-11-08 (campaign), HTML entities decoded
word_sentiment      r-cran-tidytext: data/Rdata.rdb, sentiments    an English word of the Bing Liu opinion lexicon  negative, positive                          2000 / 200 / 1000
                    (the Bing lexicon)                             (words listed with both labels are dropped)
word_pos            r-cran-tidytext: data/Rdata.rdb,               a lower-case English word (Moby part-of-speech   adjective, adverb, noun, verb               2000 / 200 / 1000
                    parts_of_speech                                list) all of whose entries map to one coarse
                                                                   class: Noun/Plural -> noun, the three Verb
                                                                   tags -> verb, Adjective, Adverb
movie_genre         r-cran-dslabs: data/Rdata.rdb, movielens       a film title (", The" moved to the front) whose  Action, Comedy, Documentary, Drama, Horror   865 / 200 / 1000
                                                                   MovieLens genres contain exactly one of the
                                                                   five labels (other genres may also be listed)
review_sentiment    r-cran-modeldata: data/Rdata.rdb,              an Amazon fine-food review (``<br />`` removed;  great (5 stars), other (1-4 stars)          2000 / 200 / 1000
                    training_data + testing_data                   often longer than 128 tokens, truncate it)
                    (small_fine_foods)
wordnet_supersense  wordnet-base: /usr/share/wordnet/data.noun     the definition of a WordNet 3.0 noun synset      animal, artifact, food, location, person,   1998 / 204 / 1002
                                                                   (its gloss without the quoted examples)          plant
verb_supersense     wordnet-base: /usr/share/wordnet/data.verb     the definition of a WordNet 3.0 verb synset      change, communication, contact, motion,     1998 / 204 / 1002
                                                                   (its gloss without the quoted examples)          possession, social
word_relation       wordnet-base: /usr/share/wordnet/data.{noun,   two one-word lemmas ``"first ; second"``: a      antonym, hypernym, part, synonym            2000 / 200 / 1000
                    verb,adj,adv}: synsets and pointers            synset's first two lemmas (synonym), a ``!``
                                                                   pointer (antonym), a noun or verb and its
                                                                   direct ``@`` hypernym, a part and its whole
                                                                   (``%p``); the pair-input task
==================  =============================================  ===============================================  ==========================================  ==================

How a task is built and split
-----------------------------
1. The source rows are turned into ``(text, label)`` pairs; whitespace is collapsed,
   empty texts are dropped, a text that occurs with two different labels is dropped,
   and duplicates are merged. The pairs are sorted by text (a stable, machine-
   independent order that does not depend on the package's row order).
2. Built-in tasks are balanced: with ``k`` labels, validation and test get
   ``ceil(n / k)`` examples of every label (``n`` = ``n_val``, ``n_test``: at least ``n``
   in all) and train ``max_train // k``; when the rarest label has too few examples the
   train split gets what is left after validation and test (``movie_genre``: 173 per
   label).
3. Per label, a permutation drawn from a PCG64 stream (numpy's default bit generator)
   seeded by ``SeedSequence([seed, crc32(task name), label index])`` picks validation
   examples first, then test, then train, so changing ``max_train`` never changes the
   validation or test split. Raw bit-generator output (``random_raw``) is used, whose
   stream numpy keeps stable across versions and machines. Each split is then shuffled
   (same construction) so labels are interleaved.

User tasks (``--task NAME=PATH.csv``) come from a CSV file with a header naming at
least the columns ``text`` and ``label``; see :func:`load_csv_task`. They are split
per label in proportion (stratified), not balanced.
"""

from __future__ import annotations

import bz2
import csv
import datetime as _dt
import functools
import gzip
import html
import lzma
import re
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from ..errors import InputError, MissingFileError

__all__ = [
    "APT_INSTALL_COMMAND",
    "APT_PACKAGES",
    "BUILTIN_TASKS",
    "DEFAULT_MAX_TRAIN",
    "DEFAULT_N_TEST",
    "DEFAULT_N_VAL",
    "TASK_INFO",
    "Split",
    "Task",
    "TaskDataError",
    "TaskDataMissingError",
    "TaskInfo",
    "data_available",
    "describe",
    "load_csv_task",
    "load_task",
    "load_task_arg",
    "load_tasks",
    "parse_task_arg",
    "read_r_lazyload",
    "read_r_serialized",
]

APT_PACKAGES: tuple[str, ...] = (
    "r-cran-dslabs",
    "r-cran-janeaustenr",
    "r-cran-modeldata",
    "r-cran-tidytext",
    "wordnet-base",
)
APT_INSTALL_COMMAND = "apt-get install -y --no-install-recommends " + " ".join(APT_PACKAGES)

#: Directories searched, in order, for ``<package>/data/Rdata.rdx``.
R_LIBRARY_DIRS: tuple[str, ...] = (
    "/usr/lib/R/site-library",
    "/usr/local/lib/R/site-library",
    "/usr/lib/R/library",
)
#: Directories searched, in order, for WordNet's ``data.noun``.
WORDNET_DIRS: tuple[str, ...] = ("/usr/share/wordnet",)

DEFAULT_MAX_TRAIN = 2000
DEFAULT_N_VAL = 200
DEFAULT_N_TEST = 1000


class TaskDataError(InputError):
    """A task's data or arguments cannot make a usable task (bad CSV, bad sizes)."""


class TaskDataMissingError(MissingFileError):
    """A built-in task's Debian data files are not installed.

    ``install_command`` is the ``apt-get`` line that installs them.
    """

    def __init__(self, task: str, package: str, looked_for: Sequence[Path]) -> None:
        self.task = task
        self.package = package
        self.looked_for = tuple(looked_for)
        self.install_command = f"apt-get install -y --no-install-recommends {package}"
        tried = ", ".join(str(p) for p in self.looked_for)
        super().__init__(
            f"data for task {task!r} is missing: no {tried}. It comes from the Debian "
            f"package {package}; install it with `{self.install_command}` "
            f"(all built-in tasks: `{APT_INSTALL_COMMAND}`)"
        )


# --------------------------------------------------------------------------------------
# A minimal reader of R's serialization format (XDR, versions 2 and 3).
# --------------------------------------------------------------------------------------

_NILVALUE, _REFSXP = 254, 255
_SINGLETONS = frozenset({253, 252, 251, 250, 242, 241})  # global/base/empty env, markers
_PAIRLISTS = frozenset({2, 6, 239, 240})  # LISTSXP, LANGSXP, ATTRLISTSXP, ATTRLANGSXP
_ALTREP = 238


class _RReader:
    """Decodes the subset of R objects data sets use; anything else raises ``ValueError``.

    Vectors of numbers become numpy arrays (NA integers stay R's ``-2**31``), character
    vectors lists of ``str`` (``None`` for NA), factors lists of their level strings,
    named lists (data frames) ``dict``s, pairlists ``dict``s or lists of pairs.
    """

    def __init__(self, data: bytes) -> None:
        self.buf = memoryview(data)
        self.pos = 0
        self.refs: list[Any] = []

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self.buf, self.pos)
        self.pos += 4
        return value

    def _length(self) -> int:
        n = self._int()
        if n == -1:
            hi, lo = self._int(), self._int()
            n = (hi << 32) + lo
        if n < 0 or n > len(self.buf):
            raise InputError(f"corrupt R serialization: vector length {n}")
        return n

    def read(self) -> Any:
        if bytes(self.buf[:2]) != b"X\n":
            raise InputError("not an R serialization in XDR format (expected 'X\\n')")
        self.pos = 2
        version = self._int()
        self._int()  # R version that wrote it
        self._int()  # minimal R version to read it
        if version == 3:
            encoding_length = self._int()
            self.pos += encoding_length  # skip the native encoding's name
        elif version != 2:
            raise InputError(f"unsupported R serialization version {version}")
        return self._item()

    def _array(self, dtype: str, size: int) -> np.ndarray:
        n = self._length()
        out = np.frombuffer(self.buf, dtype, n, self.pos).astype(dtype[1:])
        self.pos += size * n
        return out

    def _item(self) -> Any:
        flags = self._int()
        kind = flags & 0xFF
        if kind == _NILVALUE or kind in _SINGLETONS:
            return None
        if kind == _REFSXP:
            index = flags >> 8 or self._int()
            return self.refs[index - 1]
        if kind == 1:  # SYMSXP: a CHARSXP follows
            name = self._item()
            self.refs.append(name)
            return name
        if kind in _PAIRLISTS:
            return self._pairlist(flags)
        if kind == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None
            raw = bytes(self.buf[self.pos : self.pos + n])
            self.pos += n
            latin1 = (flags >> 12) & 4
            return raw.decode("latin-1" if latin1 else "utf-8", errors="replace")
        if kind == _ALTREP:
            return self._altrep()
        if kind in (10, 13):  # LGLSXP, INTSXP
            value: Any = self._array(">i4", 4)
        elif kind == 14:  # REALSXP
            value = self._array(">f8", 8)
        elif kind == 15:  # CPLXSXP
            value = self._array(">c16", 16)
        elif kind in (16, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            value = [self._item() for _ in range(self._length())]
        elif kind == 24:  # RAWSXP
            n = self._length()
            value = bytes(self.buf[self.pos : self.pos + n])
            self.pos += n
        else:
            raise InputError(f"unsupported R object type {kind} in serialized data")
        attrs = self._item() if flags & (1 << 9) else None
        return self._with_attributes(kind, value, attrs)

    @staticmethod
    def _with_attributes(kind: int, value: Any, attrs: Any) -> Any:
        if not isinstance(attrs, dict):
            return value
        if kind in (19, 20) and attrs.get("names") is not None:
            return dict(zip(attrs["names"], value, strict=True))
        if kind == 13 and attrs.get("levels") is not None:  # factor
            levels = attrs["levels"]
            return [levels[c - 1] if 0 < c <= len(levels) else None for c in value.tolist()]
        return value

    def _pairlist(self, flags: int) -> Any:
        items: list[tuple[Any, Any]] = []
        while True:
            if flags & (1 << 9):
                self._item()  # attributes of the cell: unused
            tag = self._item() if flags & (1 << 10) else None
            items.append((tag, self._item()))
            flags = self._int()
            if flags & 0xFF not in _PAIRLISTS:
                self.pos -= 4
                self._item()  # the tail, R_NilValue for a proper list
                break
        if all(isinstance(tag, str) for tag, _ in items):
            return dict(items)
        return items

    def _altrep(self) -> Any:
        info = self._item()
        state = self._item()
        attrs = self._item()
        name = info[0][1] if isinstance(info, list) and info else None
        if name in ("compact_intseq", "compact_realseq"):
            n, start, step = (float(x) for x in state[:3])
            dtype = np.int32 if name == "compact_intseq" else np.float64
            value: Any = (start + step * np.arange(int(n))).astype(dtype)
            kind = 13 if name == "compact_intseq" else 14
        elif isinstance(name, str) and name.startswith("wrap_"):
            value, kind = state[0], 19 if isinstance(state[0], list) else 13
        elif name == "deferred_string":
            source = state[0][1] if isinstance(state, list) else next(iter(state.values()))
            value, kind = [str(x) for x in np.asarray(source).tolist()], 16
        else:
            raise InputError(f"unsupported R ALTREP class {name!r} in serialized data")
        return self._with_attributes(kind, value, attrs)


def read_r_serialized(data: bytes) -> Any:
    """Decode one R object serialized in XDR format (an uncompressed ``.rds`` body)."""
    return _RReader(data).read()


def _decompress_lazyload_entry(blob: bytes, compressed: int) -> bytes:
    if len(blob) < 5:
        raise InputError("corrupt lazy-load entry")
    (size,) = struct.unpack_from(">I", blob, 0)
    if compressed in (2, 3):  # a one-byte type follows the length (R_decompress2/3)
        kind, body = blob[4:5], blob[5:]
        if kind == b"Z":  # R's raw LZMA2 stream, preset 6
            out = lzma.decompress(
                body, format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2, "preset": 6}]
            )
        elif kind == b"2":
            out = bz2.decompress(body)
        elif kind == b"1":
            out = zlib.decompress(body)
        elif kind == b"0":
            out = body
        else:
            raise InputError(f"unknown lazy-load compression type {kind!r}")
    else:
        out = zlib.decompress(blob[4:])
    if len(out) != size:
        raise InputError("corrupt lazy-load entry: wrong decompressed length")
    return out


def read_r_lazyload(base: str | Path, name: str) -> Any:
    """Read object ``name`` from the R lazy-load database ``base``.rdx/``base``.rdb.

    ``base`` is e.g. ``/usr/lib/R/site-library/dslabs/data/Rdata``. The ``.rdx`` index
    is a gzip-compressed serialized list whose ``variables`` maps each name to an
    (offset, length) pair into the ``.rdb`` file.
    """
    base = Path(base)
    with open(f"{base}.rdx", "rb") as f:
        raw = f.read()
    index = read_r_serialized(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    variables = index["variables"]
    if name not in variables:
        raise KeyError(f"{name!r} is not in {base}.rdx (it holds {sorted(variables)})")
    offset, length = (int(x) for x in variables[name])
    compressed = int(np.asarray(index.get("compressed", [1])).ravel()[0])
    with open(f"{base}.rdb", "rb") as f:
        f.seek(offset)
        blob = f.read(length)
    return read_r_serialized(_decompress_lazyload_entry(blob, compressed))


# --------------------------------------------------------------------------------------
# Locating the Debian data.
# --------------------------------------------------------------------------------------


def _r_data_base(task: str, package: str, r_dirs: Sequence[str]) -> Path:
    candidates = [Path(d) / package / "data" / "Rdata.rdx" for d in r_dirs]
    for rdx in candidates:
        if rdx.is_file() and rdx.with_suffix(".rdb").is_file():
            return rdx.with_suffix("")
    raise TaskDataMissingError(task, f"r-cran-{package.lower()}", candidates)


def _wordnet_file(task: str, name: str, wn_dirs: Sequence[str]) -> Path:
    candidates = [Path(d) / name for d in wn_dirs]
    for path in candidates:
        if path.is_file():
            return path
    raise TaskDataMissingError(task, "wordnet-base", candidates)


def _clean(text: str | None) -> str:
    return " ".join(text.split()) if text else ""


# --------------------------------------------------------------------------------------
# The built-in tasks' source rows.
# --------------------------------------------------------------------------------------

_Rows = list[tuple[str, str]]

_AUSTEN = (
    ("emma", "Emma"),
    ("mansfieldpark", "Mansfield Park"),
    ("northangerabbey", "Northanger Abbey"),
    ("persuasion", "Persuasion"),
    ("prideprejudice", "Pride and Prejudice"),
    ("sensesensibility", "Sense and Sensibility"),
)


def _austen_rows(r_dirs: Sequence[str], wn_dirs: Sequence[str]) -> _Rows:
    base = _r_data_base("austen_novel", "janeaustenr", r_dirs)
    rows: _Rows = []
    for obj, title in _AUSTEN:
        lines = read_r_lazyload(base, obj)
        paragraph: list[str] = []
        for line in [*lines, ""]:
            line = _clean(line)
            if line:
                paragraph.append(line)
                continue
            for i in range(0, len(paragraph) - 1, 2):
                passage = f"{paragraph[i]} {paragraph[i + 1]}"
                if len(passage.split()) >= 8:
                    rows.append((passage, title))
            paragraph = []
    return rows


_CAMPAIGN = (
    _dt.datetime(2015, 6, 16, tzinfo=_dt.UTC).timestamp(),
    _dt.datetime(2016, 11, 9, tzinfo=_dt.UTC).timestamp(),
)
_TWEET_SOURCES = {"Twitter for Android": "Android", "Twitter for iPhone": "iPhone"}


def _tweet_rows(r_dirs: Sequence[str], wn_dirs: Sequence[str]) -> _Rows:
    tweets = read_r_lazyload(_r_data_base("tweet_source", "dslabs", r_dirs), "trump_tweets")
    rows: _Rows = []
    for text, source, when in zip(
        tweets["text"], tweets["source"], tweets["created_at"].tolist(), strict=True
    ):
        if source in _TWEET_SOURCES and _CAMPAIGN[0] <= when < _CAMPAIGN[1]:
            rows.append((html.unescape(text or ""), _TWEET_SOURCES[source]))
    return rows


def _sentiment_rows(r_dirs: Sequence[str], wn_dirs: Sequence[str]) -> _Rows:
    lexicon = read_r_lazyload(_r_data_base("word_sentiment", "tidytext", r_dirs), "sentiments")
    return list(zip(lexicon["word"], lexicon["sentiment"], strict=True))


_COARSE_POS = {
    "Noun": "noun",
    "Plural": "noun",
    "Verb (usu participle)": "verb",
    "Verb (transitive)": "verb",
    "Verb (intransitive)": "verb",
    "Adjective": "adjective",
    "Adverb": "adverb",
}
_LOWER_WORD = re.compile(r"[a-z]+(?:[-'][a-z]+)*")


def _pos_rows(r_dirs: Sequence[str], wn_dirs: Sequence[str]) -> _Rows:
    table = read_r_lazyload(_r_data_base("word_pos", "tidytext", r_dirs), "parts_of_speech")
    classes: dict[str, set[str | None]] = {}
    for word, pos in zip(table["word"], table["pos"], strict=True):
        if word and _LOWER_WORD.fullmatch(word):
            classes.setdefault(word, set()).add(_COARSE_POS.get(pos))
    return [(w, c.pop()) for w, c in classes.items() if len(c) == 1 and None not in c]


_GENRES = ("Action", "Comedy", "Documentary", "Drama", "Horror")
_TRAILING_ARTICLE = re.compile(r"^(.*), (The|A|An)$")


def _movie_rows(r_dirs: Sequence[str], wn_dirs: Sequence[str]) -> _Rows:
    ratings = read_r_lazyload(_r_data_base("movie_genre", "dslabs", r_dirs), "movielens")
    pairs = zip(ratings["title"], ratings["genres"], strict=True)
    movies = dict(zip(ratings["movieId"].tolist(), pairs, strict=True))
    rows: _Rows = []
    for title, genres in movies.values():
        hits = [g for g in (genres or "").split("|") if g in _GENRES]
        if title and len(hits) == 1:
            rows.append((_TRAILING_ARTICLE.sub(r"\2 \1", title.strip()), hits[0]))
    return rows


_BR = re.compile(r"<br\s*/?>", re.IGNORECASE)


def _review_rows(r_dirs: Sequence[str], wn_dirs: Sequence[str]) -> _Rows:
    base = _r_data_base("review_sentiment", "modeldata", r_dirs)
    rows: _Rows = []
    for obj in ("training_data", "testing_data"):
        frame = read_r_lazyload(base, obj)
        for review, score in zip(frame["review"], frame["score"], strict=True):
            rows.append((html.unescape(_BR.sub(" ", review or "")), score))
    return rows


_LEXNAMES = {5: "animal", 6: "artifact", 13: "food", 15: "location", 18: "person", 20: "plant"}
_EXAMPLE = re.compile(r';?\s*"')


def _wordnet_rows(r_dirs: Sequence[str], wn_dirs: Sequence[str]) -> _Rows:
    path = _wordnet_file("wordnet_supersense", "data.noun", wn_dirs)
    rows: _Rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith(" ") or " | " not in line:  # the licence header
                continue
            fields, gloss = line.split(" | ", 1)
            label = _LEXNAMES.get(int(fields.split()[1]))
            if label is not None:
                rows.append((_EXAMPLE.split(gloss, maxsplit=1)[0].strip(" ;"), label))
    return rows


_VERB_LEXNAMES = {
    30: "change",
    32: "communication",
    35: "contact",
    38: "motion",
    40: "possession",
    41: "social",
}


def _verb_rows(r_dirs: Sequence[str], wn_dirs: Sequence[str]) -> _Rows:
    path = _wordnet_file("verb_supersense", "data.verb", wn_dirs)
    rows: _Rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith(" ") or " | " not in line:
                continue
            fields, gloss = line.split(" | ", 1)
            label = _VERB_LEXNAMES.get(int(fields.split()[1]))
            if label is not None:
                rows.append((_EXAMPLE.split(gloss, maxsplit=1)[0].strip(" ;"), label))
    return rows


#: Separator of the two words of a pair task's text (``"wheel ; car"``); WordNet lemmas never
#: contain it, and a prompt builder splits on it.
PAIR_SEP = " ; "
_ADJ_MARKER = re.compile(r"\((?:a|p|ip)\)$")
_ONE_WORD = re.compile(r"[a-z]+(?:-[a-z]+)*")


class _Synset:
    __slots__ = ("lemmas", "pointers")

    def __init__(self, lemmas: list[str], pointers: list[tuple[str, str, str, int, int]]):
        self.lemmas = lemmas
        self.pointers = pointers


def _read_synsets(path: Path, pos: str) -> dict[tuple[str, str], _Synset]:
    """WordNet ``data.<pos>`` as ``{(pos letter, offset): synset}`` (lemmas, pointers)."""
    out: dict[tuple[str, str], _Synset] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith(" ") or " | " not in line:
                continue
            fields = line.split(" | ", 1)[0].split()
            offset, ss_type = fields[0], fields[2]
            n_words = int(fields[3], 16)
            lemmas = [
                _ADJ_MARKER.sub("", fields[4 + 2 * k]).replace("_", " ").lower()
                for k in range(n_words)
            ]
            i = 4 + 2 * n_words
            n_ptr = int(fields[i])
            i += 1
            pointers = []
            for _ in range(n_ptr):
                sym, target, tpos, st = fields[i : i + 4]
                i += 4
                pointers.append(
                    (sym, target, "a" if tpos == "s" else tpos, int(st[:2], 16), int(st[2:], 16))
                )
            out[("a" if ss_type == "s" else ss_type, offset)] = _Synset(lemmas, pointers)
    return out


def _relation_rows(r_dirs: Sequence[str], wn_dirs: Sequence[str]) -> _Rows:
    """Pairs of one-word WordNet lemmas and their relation (the pair-input task).

    ``synonym``: the first two one-word lemmas of a synset; ``antonym``: a lexical ``!``
    pointer (any part of speech); ``hypernym``: a noun or verb and the first lemma of its
    direct hypernym (``@``), ``"dog ; canine"``; ``part``: a part and its whole (a noun's
    ``%p`` part meronym), ``"wheel ; car"``. Order matters for hypernym and part.
    """
    synsets: dict[tuple[str, str], _Synset] = {}
    for pos in ("noun", "verb", "adj", "adv"):
        synsets.update(_read_synsets(_wordnet_file("word_relation", f"data.{pos}", wn_dirs), pos))

    def word(s: _Synset, k: int = 0) -> str | None:
        if k < 0:
            return next((w for w in s.lemmas if _ONE_WORD.fullmatch(w)), None)
        w = s.lemmas[k] if k < len(s.lemmas) else ""
        return w if _ONE_WORD.fullmatch(w) else None

    rows: _Rows = []
    for (pos, _), syn in synsets.items():
        ones = [w for w in dict.fromkeys(syn.lemmas) if _ONE_WORD.fullmatch(w)]
        if len(ones) >= 2:
            rows.append((ones[0] + PAIR_SEP + ones[1], "synonym"))
        for sym, target, tpos, src, dst in syn.pointers:
            other = synsets.get((tpos, target))
            if other is None:
                continue
            if sym == "!" and src and dst:
                a, b = word(syn, src - 1), word(other, dst - 1)
                if a and b and a < b:  # each antonym pair is listed from both sides: keep one
                    rows.append((a + PAIR_SEP + b, "antonym"))
            elif sym == "@" and pos in ("n", "v"):
                a, b = word(syn, -1), word(other, -1)
                if a and b and a != b:
                    rows.append((a + PAIR_SEP + b, "hypernym"))
            elif sym == "%p":
                a, b = word(other, -1), word(syn, -1)
                if a and b and a != b:
                    rows.append((a + PAIR_SEP + b, "part"))
    return rows


@dataclass(frozen=True)
class TaskInfo:
    """What a built-in task is made of; no data is read to make one.

    ``label_texts[i]`` is the short description of ``labels[i]`` whose base-model embedding is the
    task's frozen zero-shot head (the analogue of CLIP's ``"a photo of a {label}"`` text heads).
    ``pair`` tasks hold two words joined by :data:`PAIR_SEP` in each text.
    """

    name: str
    labels: tuple[str, ...]
    apt_package: str
    source: str
    text: str
    label: str
    label_texts: tuple[str, ...]
    #: (train, val, test) sizes for the default ``max_train``/``n_val``/``n_test``.
    default_sizes: tuple[int, int, int]
    rows: Callable[[Sequence[str], Sequence[str]], _Rows] = field(repr=False, compare=False)
    pair: bool = False

    def __post_init__(self) -> None:
        if len(self.label_texts) != len(self.labels):
            raise InputError(f"task {self.name!r}: one label text per label")


TASK_INFO: Mapping[str, TaskInfo] = MappingProxyType(
    {
        info.name: info
        for info in (
            TaskInfo(
                "austen_novel",
                tuple(title for _, title in _AUSTEN),
                "r-cran-janeaustenr",
                "janeaustenr data/Rdata.rdb: " + ", ".join(obj for obj, _ in _AUSTEN),
                "two consecutive lines of one paragraph (>= 8 words)",
                "the novel the passage comes from",
                tuple(f"a passage from Jane Austen's novel {title}" for _, title in _AUSTEN),
                (1998, 204, 1002),
                _austen_rows,
            ),
            TaskInfo(
                "tweet_source",
                ("Android", "iPhone"),
                "r-cran-dslabs",
                "dslabs data/Rdata.rdb: trump_tweets",
                "a @realDonaldTrump tweet of 2015-06-16..2016-11-08",
                "the client it was posted from (Twitter for Android / for iPhone)",
                ("a tweet posted from an Android phone", "a tweet posted from an iPhone"),
                (2000, 200, 1000),
                _tweet_rows,
            ),
            TaskInfo(
                "word_sentiment",
                ("negative", "positive"),
                "r-cran-tidytext",
                "tidytext data/Rdata.rdb: sentiments (Bing Liu lexicon)",
                "one English word",
                "its sentiment in the Bing lexicon",
                ("a negative word", "a positive word"),
                (2000, 200, 1000),
                _sentiment_rows,
            ),
            TaskInfo(
                "word_pos",
                ("adjective", "adverb", "noun", "verb"),
                "r-cran-tidytext",
                "tidytext data/Rdata.rdb: parts_of_speech (Moby)",
                "one lower-case English word with a single coarse part of speech",
                "that coarse part of speech",
                ("an adjective", "an adverb", "a noun", "a verb"),
                (2000, 200, 1000),
                _pos_rows,
            ),
            TaskInfo(
                "movie_genre",
                _GENRES,
                "r-cran-dslabs",
                "dslabs data/Rdata.rdb: movielens",
                "a film title",
                "the one of its MovieLens genres that is among the labels",
                (
                    "an action movie",
                    "a comedy movie",
                    "a documentary film",
                    "a drama film",
                    "a horror movie",
                ),
                (865, 200, 1000),
                _movie_rows,
            ),
            TaskInfo(
                "review_sentiment",
                ("great", "other"),
                "r-cran-modeldata",
                "modeldata data/Rdata.rdb: training_data + testing_data (small_fine_foods)",
                "an Amazon fine-food review",
                "great = 5-star rating, other = 1-4 stars",
                ("a glowing five-star review", "a mixed or negative review"),
                (2000, 200, 1000),
                _review_rows,
            ),
            TaskInfo(
                "wordnet_supersense",
                tuple(sorted(_LEXNAMES.values())),
                "wordnet-base",
                "wordnet-base /usr/share/wordnet/data.noun",
                "the definition of a WordNet 3.0 noun synset",
                "its lexicographer file (noun.animal, noun.artifact, ...)",
                (
                    "an animal",
                    "a man-made object",
                    "food or drink",
                    "a place",
                    "a person",
                    "a plant",
                ),
                (1998, 204, 1002),
                _wordnet_rows,
            ),
            TaskInfo(
                "verb_supersense",
                tuple(sorted(_VERB_LEXNAMES.values())),
                "wordnet-base",
                "wordnet-base /usr/share/wordnet/data.verb",
                "the definition of a WordNet 3.0 verb synset",
                "its lexicographer file (verb.change, verb.communication, ...)",
                (
                    "to change or become different",
                    "to talk, write or communicate",
                    "to touch, hit or hold something",
                    "to move or travel",
                    "to own, give, buy or take something",
                    "to meet, work or deal with other people",
                ),
                (1998, 204, 1002),
                _verb_rows,
            ),
            TaskInfo(
                "word_relation",
                ("antonym", "hypernym", "part", "synonym"),
                "wordnet-base",
                "wordnet-base /usr/share/wordnet/data.{noun,verb,adj,adv}: pointers and synsets",
                "two one-word WordNet lemmas, 'first ; second'",
                "how they relate: antonym (!), hypernym (second is the first's direct @), part "
                "(first is a %p part of second), synonym (same synset)",
                (
                    "two words with opposite meanings",
                    "a word and a more general category it belongs to",
                    "a part and the whole it belongs to",
                    "two words with the same meaning",
                ),
                (2000, 200, 1000),
                _relation_rows,
                pair=True,
            ),
        )
    }
)

BUILTIN_TASKS: tuple[str, ...] = tuple(TASK_INFO)


# --------------------------------------------------------------------------------------
# Tasks and splits.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Split:
    """Texts and their label ids (``int32``, indices into ``Task.labels``)."""

    texts: tuple[str, ...]
    labels: np.ndarray

    def __post_init__(self) -> None:
        labels = np.asarray(self.labels, dtype=np.int32).copy()
        labels.setflags(write=False)
        object.__setattr__(self, "labels", labels)
        object.__setattr__(self, "texts", tuple(self.texts))
        if labels.shape != (len(self.texts),):
            raise InputError(f"{len(self.texts)} texts but labels of shape {labels.shape}")

    def __len__(self) -> int:
        return len(self.texts)


@dataclass(frozen=True, eq=False)
class Task:
    """A text classification task with fixed train/validation/test splits.

    Attributes:
      name: task name.
      labels: label names; label id ``i`` is ``labels[i]``.
      train, val, test: the splits (disjoint).
      source: where the data comes from.
      label_texts: one short description per label; their base-model embeddings are the task's
        frozen zero-shot head (default: the label names).
      pair: each text is two words joined by :data:`PAIR_SEP`.
    """

    name: str
    labels: tuple[str, ...]
    train: Split
    val: Split
    test: Split
    source: str = ""
    label_texts: tuple[str, ...] = ()
    pair: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", tuple(self.labels))
        texts = tuple(self.label_texts) or self.labels
        if len(texts) != len(self.labels):
            raise TaskDataError(
                f"task {self.name!r}: {len(texts)} label texts for {len(self.labels)} labels; "
                "give one description per label"
            )
        object.__setattr__(self, "label_texts", texts)

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @property
    def splits(self) -> dict[str, Split]:
        return {"train": self.train, "val": self.val, "test": self.test}

    def describe(self) -> str:
        """A one-paragraph summary: source, labels and per-split label counts."""
        lines = [f"{self.name}: {self.num_labels} labels, source {self.source or '?'}"]
        for split_name, split in self.splits.items():
            counts = np.bincount(split.labels, minlength=self.num_labels)
            per_label = ", ".join(f"{lab}={c}" for lab, c in zip(self.labels, counts, strict=True))
            lines.append(f"  {split_name:5s} {len(split):5d}  ({per_label})")
        return "\n".join(lines)


def describe(name: str | None = None) -> str:
    """A table of the built-in tasks (or one of them), without reading any data."""
    names = BUILTIN_TASKS if name is None else (_info(name).name,)
    out = []
    for n in names:
        info = TASK_INFO[n]
        heads = "; ".join(
            f"{lab}: {t!r}" for lab, t in zip(info.labels, info.label_texts, strict=True)
        )
        out.append(
            f"{n}: {info.text} -> {info.label}\n"
            f"  labels: {', '.join(info.labels)}\n"
            f"  zero-shot head texts: {heads}\n"
            f"  source: {info.source} (Debian package {info.apt_package})"
        )
    return "\n".join(out)


def _info(name: str) -> TaskInfo:
    try:
        return TASK_INFO[name]
    except KeyError:
        raise KeyError(
            f"unknown task {name!r}; built-in tasks are {', '.join(BUILTIN_TASKS)} "
            "(or give NAME=PATH.csv for a task of your own)"
        ) from None


def _permutation(n: int, seed: int, *keys: int) -> np.ndarray:
    """A permutation of ``range(n)`` that is the same on every machine and numpy version."""
    bits = np.random.PCG64(np.random.SeedSequence([seed, *keys])).random_raw(n)
    return np.argsort(bits, kind="stable")


def _name_key(name: str) -> int:
    return zlib.crc32(name.encode("utf-8"))


def _check_sizes(seed: int, max_train: int, n_val: int, n_test: int) -> None:
    for arg, value, low in (("seed", seed, 0), ("max_train", max_train, 1)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
            raise TaskDataError(f"{arg} must be an integer >= {low}, got {value!r}")
    for arg, value in (("n_val", n_val), ("n_test", n_test)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise TaskDataError(f"{arg} must be an integer >= 1, got {value!r}")


def _dedupe(rows: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """Clean texts, drop empty and ambiguous ones; texts per label, each sorted."""
    seen: dict[str, str | None] = {}
    for text, label in rows:
        text = _clean(text)
        if text and label is not None:
            label = str(label)
            seen[text] = label if seen.get(text, label) == label else None
    by_label: dict[str, list[str]] = {}
    for text in sorted(seen):
        label = seen[text]
        if label is not None:
            by_label.setdefault(label, []).append(text)
    return by_label


def _assemble(
    name: str,
    labels: tuple[str, ...],
    parts: dict[str, list[tuple[str, int]]],
    seed: int,
    source: str,
    label_texts: tuple[str, ...] = (),
    pair: bool = False,
) -> Task:
    splits = {}
    for i, split_name in enumerate(("train", "val", "test")):
        items = parts[split_name]
        order = _permutation(len(items), seed, _name_key(name), 1_000_000 + i)
        splits[split_name] = Split(
            texts=tuple(items[j][0] for j in order),
            labels=np.array([items[j][1] for j in order], dtype=np.int32),
        )
    return Task(
        name=name, labels=labels, source=source, label_texts=label_texts, pair=pair, **splits
    )


def _balanced_split(
    name: str,
    labels: tuple[str, ...],
    by_label: Mapping[str, Sequence[str]],
    *,
    seed: int,
    max_train: int,
    n_val: int,
    n_test: int,
    source: str,
    label_texts: tuple[str, ...] = (),
    pair: bool = False,
) -> Task:
    k = len(labels)
    # at least n_val / n_test in all (a ceiling per label), at most max_train
    val_per, test_per = -(-n_val // k), -(-n_test // k)
    if max_train < k:
        raise TaskDataError(
            f"task {name!r} has {k} labels: max_train, n_val and n_test must each be >= {k}"
        )
    fewest = min(len(by_label.get(label, ())) for label in labels)
    train_per = min(max_train // k, fewest - val_per - test_per)
    if train_per < 1:
        raise TaskDataError(
            f"task {name!r}: the rarest label has {fewest} examples, too few for "
            f"{val_per} validation + {test_per} test + 1 train example per label"
        )
    parts: dict[str, list[tuple[str, int]]] = {"train": [], "val": [], "test": []}
    for index, label in enumerate(labels):
        texts = by_label[label]
        order = _permutation(len(texts), seed, _name_key(name), index)
        picked = [(texts[j], index) for j in order[: val_per + test_per + train_per]]
        parts["val"] += picked[:val_per]
        parts["test"] += picked[val_per : val_per + test_per]
        parts["train"] += picked[val_per + test_per :]
    return _assemble(name, labels, parts, seed, source, label_texts, pair)


@functools.lru_cache(maxsize=16)
def _cached_rows(
    name: str, r_dirs: tuple[str, ...], wn_dirs: tuple[str, ...]
) -> Mapping[str, tuple[str, ...]]:
    """A built-in task's texts per label, kept in memory (keyed by the data directories)."""
    info = TASK_INFO[name]
    by_label = _dedupe(info.rows(r_dirs, wn_dirs))
    unexpected = set(by_label) - set(info.labels)
    if unexpected:
        raise TaskDataError(f"task {name!r}: unexpected labels {sorted(unexpected)} in the data")
    return MappingProxyType({label: tuple(texts) for label, texts in by_label.items()})


def data_available(name: str) -> bool:
    """Whether the Debian data that built-in task ``name`` needs is installed."""
    info = _info(name)
    if info.apt_package == "wordnet-base":
        return any((Path(d) / "data.noun").is_file() for d in WORDNET_DIRS)
    package = info.apt_package.removeprefix("r-cran-")
    return any(
        (Path(d) / package / "data" / "Rdata.rdx").is_file()
        and (Path(d) / package / "data" / "Rdata.rdb").is_file()
        for d in R_LIBRARY_DIRS
    )


def load_task(
    name: str,
    *,
    seed: int = 0,
    max_train: int = DEFAULT_MAX_TRAIN,
    n_val: int = DEFAULT_N_VAL,
    n_test: int = DEFAULT_N_TEST,
) -> Task:
    """Load built-in task ``name`` with balanced, seed-determined splits.

    Validation and test hold ``ceil(n / len(labels))`` examples of every label (``n`` being
    ``n_val`` or ``n_test``), train ``max_train // len(labels)``, fewer when the rarest label
    runs out. Raises :class:`TaskDataMissingError` (naming the ``apt-get install`` line) when
    the Debian data is not installed, ``KeyError`` for an unknown name.
    """
    info = _info(name)
    _check_sizes(seed, max_train, n_val, n_test)
    by_label = _cached_rows(name, tuple(R_LIBRARY_DIRS), tuple(WORDNET_DIRS))
    return _balanced_split(
        name,
        info.labels,
        by_label,
        seed=seed,
        max_train=max_train,
        n_val=n_val,
        n_test=n_test,
        source=f"{info.source} (Debian package {info.apt_package})",
        label_texts=info.label_texts,
        pair=info.pair,
    )


def load_tasks(
    names: Iterable[str] | None = None,
    *,
    seed: int = 0,
    max_train: int = DEFAULT_MAX_TRAIN,
    n_val: int = DEFAULT_N_VAL,
    n_test: int = DEFAULT_N_TEST,
) -> list[Task]:
    """Load several tasks (all built-in ones by default).

    A name may also be ``NAME=PATH.csv`` for a task of your own (see
    :func:`load_task_arg`).
    """
    names = BUILTIN_TASKS if names is None else (names,) if isinstance(names, str) else tuple(names)
    if len(set(names)) != len(names):
        raise TaskDataError(f"task names repeat: {list(names)}")
    kwargs = {"seed": seed, "max_train": max_train, "n_val": n_val, "n_test": n_test}
    tasks = [load_task_arg(n, **kwargs) for n in names]
    task_names = [t.name for t in tasks]
    if len(set(task_names)) != len(task_names):
        raise TaskDataError(f"task names repeat: {task_names}")
    return tasks


# --------------------------------------------------------------------------------------
# User tasks from CSV files.
# --------------------------------------------------------------------------------------

_TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def parse_task_arg(arg: str) -> tuple[str, Path]:
    """Split a ``--task NAME=PATH.csv`` argument into ``(NAME, Path(PATH.csv))``."""
    name, sep, path = arg.partition("=")
    name, path = name.strip(), path.strip()
    if not sep or not path:
        raise TaskDataError(f"expected NAME=PATH.csv for a task of your own, got {arg!r}")
    if not _TASK_NAME.fullmatch(name):
        raise TaskDataError(
            f"task name {name!r} in {arg!r} must be letters, digits, '_', '.' or '-'"
        )
    if name in TASK_INFO:
        raise TaskDataError(f"task name {name!r} is a built-in task; choose another name")
    return name, Path(path)


def load_task_arg(
    arg: str,
    *,
    seed: int = 0,
    max_train: int = DEFAULT_MAX_TRAIN,
    n_val: int = DEFAULT_N_VAL,
    n_test: int = DEFAULT_N_TEST,
) -> Task:
    """Load ``arg``: a built-in task name, or ``NAME=PATH.csv`` for a CSV task."""
    kwargs = {"seed": seed, "max_train": max_train, "n_val": n_val, "n_test": n_test}
    if "=" in arg:
        name, path = parse_task_arg(arg)
        return load_csv_task(name, path, **kwargs)
    return load_task(arg, **kwargs)


def load_csv_task(
    name: str,
    path: str | Path,
    *,
    seed: int = 0,
    max_train: int = DEFAULT_MAX_TRAIN,
    n_val: int = DEFAULT_N_VAL,
    n_test: int = DEFAULT_N_TEST,
) -> Task:
    """Load a task of your own from a UTF-8 CSV file with columns ``text`` and ``label``.

    The header row must name both columns (others are ignored). Texts are cleaned and
    deduplicated like the built-in tasks'; texts given two labels are dropped. Labels
    are strings and sorted, so label id ``i`` is the ``i``-th label in sorted order.
    Splits are stratified: every label keeps its share, with about ``n_val`` validation
    and ``n_test`` test examples in all (at most 15% and 25% of each label, and at least
    one per label in each split), the rest in train, scaled down to at most
    ``max_train``. Every label needs at least 3 examples.
    """
    _check_sizes(seed, max_train, n_val, n_test)
    path = Path(path)
    rows = _read_csv_rows(name, path)
    by_label = _dedupe(rows)
    if not by_label:
        raise TaskDataError(f"task {name!r}: {path} has no rows with a text and a label")
    labels = tuple(sorted(by_label))
    if len(labels) < 2:
        raise TaskDataError(
            f"task {name!r}: {path} has fewer than 2 labels ({list(labels)}); "
            "a classification task needs at least 2"
        )
    too_few = {lab: len(by_label[lab]) for lab in labels if len(by_label[lab]) < 3}
    if too_few:
        raise TaskDataError(
            f"task {name!r}: label(s) with too few examples to split: {too_few}; each label "
            "needs at least 3 distinct texts (one each for train, validation and test)"
        )
    return _stratified_split(
        name,
        labels,
        by_label,
        seed=seed,
        max_train=max_train,
        n_val=n_val,
        n_test=n_test,
        source=str(path),
    )


def _read_csv_rows(name: str, path: Path) -> list[tuple[str, str | None]]:
    """The ``(text, label)`` rows of a task CSV, refusing what would silently lose rows.

    Refused with :class:`TaskDataError` naming the task, the file and the line: a path that is
    not a readable file, a file that is not UTF-8, a missing or repeated header column, and a
    quote that is never closed (Python's csv module would otherwise read the rest of the file
    into one field).
    """
    where = f"task {name!r}: {path}"
    if path.is_dir():
        raise TaskDataError(f"{where} is a directory; give the CSV file inside it")
    if not path.is_file():
        raise TaskDataError(f"task {name!r}: CSV file {path} does not exist")
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f, strict=True)
            header = next(reader, None)
            if not header or not any(h.strip() for h in header):
                raise TaskDataError(f"{where} is empty (expected a header text,label)")
            names = [h.strip() for h in header]
            repeated = sorted({h for h in names if h and names.count(h) > 1})
            if repeated:
                raise TaskDataError(
                    f"{where}: the header names column(s) {', '.join(map(repr, repeated))} more "
                    f"than once ({header}); each column name must be unique"
                )
            missing = [c for c in ("text", "label") if c not in names]
            if missing:
                raise TaskDataError(
                    f"{where} has no column {' or '.join(map(repr, missing))} "
                    f"(header: {header}); expected columns text,label"
                )
            i_text, i_label = names.index("text"), names.index("label")
            rows: list[tuple[str, str | None]] = []
            start = reader.line_num + 1
            try:
                for row in reader:
                    if row:
                        text = row[i_text] if i_text < len(row) else ""
                        label = row[i_label] if i_label < len(row) else ""
                        rows.append((text or "", _clean(label) or None))
                    start = reader.line_num + 1
            except csv.Error as e:
                raise TaskDataError(
                    f"{where}: line {start}: {e} (a quote opened on line {start} is never "
                    "closed?); fix the quoting of that row"
                ) from None
    except UnicodeDecodeError as e:
        raise TaskDataError(
            f"{where} is not UTF-8 (byte {e.object[e.start : e.start + 1]!r} at offset "
            f"{e.start}); save it as UTF-8"
        ) from None
    except PermissionError:
        raise TaskDataError(f"{where} cannot be read (permission denied)") from None
    return rows


def _stratified_split(
    name: str,
    labels: tuple[str, ...],
    by_label: dict[str, list[str]],
    *,
    seed: int,
    max_train: int,
    n_val: int,
    n_test: int,
    source: str,
) -> Task:
    total = sum(len(by_label[lab]) for lab in labels)
    val_frac, test_frac = min(0.15, n_val / total), min(0.25, n_test / total)
    counts = {}
    for lab in labels:
        n = len(by_label[lab])
        val, test = max(1, int(n * val_frac)), max(1, int(n * test_frac))
        counts[lab] = (val, test, n - val - test)
    train_total = sum(c[2] for c in counts.values())
    scale = min(1.0, max_train / train_total)
    parts: dict[str, list[tuple[str, int]]] = {"train": [], "val": [], "test": []}
    for index, lab in enumerate(labels):
        val, test, train = counts[lab]
        train = max(1, int(train * scale))
        texts = by_label[lab]
        order = _permutation(len(texts), seed, _name_key(name), index)
        picked = [(texts[j], index) for j in order[: val + test + train]]
        parts["val"] += picked[:val]
        parts["test"] += picked[val : val + test]
        parts["train"] += picked[val + test :]
    return _assemble(name, labels, parts, seed, source)
