"""The built-in tasks' data: where the Debian packages keep it, and how each task's rows are read.

Every built-in task (the table in :mod:`tasks`) is made from data that Debian packages ship;
:data:`TASK_INFO` declares each one (:class:`TaskInfo`: labels, package, source, the label
descriptions of its zero-shot head, and the function reading its ``(text, label)`` rows). The
R data sets are read with :mod:`rdata_reader`; WordNet's ``data.*`` files directly. Nothing
here splits or caches: :func:`tasks.load_task` does.
"""

from __future__ import annotations

import datetime as _dt
import html
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from ...errors import InputError, MissingFileError
from .rdata_reader import read_r_lazyload

__all__ = [
    "APT_INSTALL_COMMAND",
    "APT_PACKAGES",
    "BUILTIN_TASKS",
    "PAIR_SEP",
    "TASK_INFO",
    "TaskDataMissingError",
    "TaskInfo",
    "clean",
    "describe",
    "task_info",
]

APT_PACKAGES: tuple[str, ...] = (
    "r-cran-dslabs",
    "r-cran-janeaustenr",
    "r-cran-modeldata",
    "r-cran-tidytext",
    "wordnet-base",
)
APT_INSTALL_COMMAND = "apt-get install -y --no-install-recommends " + " ".join(APT_PACKAGES)


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


def clean(text: str | None) -> str:
    """``text`` with its whitespace collapsed (``""`` for None)."""
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
            line = clean(line)
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


def describe(name: str | None = None) -> str:
    """A table of the built-in tasks (or one of them), without reading any data."""
    names = BUILTIN_TASKS if name is None else (task_info(name).name,)
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


def task_info(name: str) -> TaskInfo:
    """The :class:`TaskInfo` of built-in task ``name`` (``KeyError`` naming the known ones)."""
    try:
        return TASK_INFO[name]
    except KeyError:
        raise KeyError(
            f"unknown task {name!r}; built-in tasks are {', '.join(BUILTIN_TASKS)} "
            "(or give NAME=PATH.csv for a task of your own)"
        ) from None
