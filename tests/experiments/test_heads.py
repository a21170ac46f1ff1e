"""Zero-shot heads that cannot tell two labels apart are refused (``evaluate.zero_shot_heads``):
labels whose texts the tokenizer reads as the same tokens (emoji become [UNK], case is lowered)
get the same head vector, so the task could only be learned at chance."""

from __future__ import annotations

import importlib.util
import types

import numpy as np
import pytest

from netutility_jax.errors import InputError
from netutility_jax.experiments.models import minilm
from netutility_jax.experiments.suites import encoder_eval as ev

HAVE_WEIGHTS = importlib.util.find_spec(minilm.PACKAGE) is not None


def _task(name, labels):
    return types.SimpleNamespace(name=name, labels=tuple(labels), label_texts=tuple(labels))


class _Fixed:
    """A backbone whose embedding of a label text is given by a table (the eval set's row ``n``
    is label ``labels[n]`` of task ``task[n]``)."""

    def __init__(self, table):
        self.table = table
        self.tasks = []

    def heads(self, tasks):
        self.tasks = tasks
        return ev.zero_shot_heads(self, tasks)

    def embed(self, es):
        texts = [self.tasks[t].label_texts[lab] for t, lab in zip(es.task, es.labels, strict=True)]
        return np.asarray([self.table[t] for t in texts], np.float32)


def test_coinciding_heads_are_refused_naming_the_task_and_labels():
    e = np.eye(4, dtype=np.float32)
    table = {"yes": e[0], "no": e[1], "up": e[2], "UP": e[2] * 3.0, "down": e[3]}
    heads = _Fixed(table).heads([_task("a", ["yes", "no"]), _task("b", ["up", "down"])])
    assert [h.vectors.shape for h in heads] == [(2, 4), (2, 4)]
    with pytest.raises(InputError, match=r"task 'b': the labels 'up' and 'UP' get the same"):
        _Fixed(table).heads([_task("a", ["yes", "no"]), _task("b", ["up", "down", "UP"])])
    # nearly the same but distinct vectors are a head, however poor
    table["UP"] = e[2] + 1e-2 * e[3]
    _Fixed(table).heads([_task("b", ["up", "down", "UP"])])


@pytest.mark.skipif(not HAVE_WEIGHTS, reason="the pretrained MiniLM is not installed")
def test_emoji_labels_get_the_same_minilm_head_and_are_refused():
    backbone = ev.Backbone()
    with pytest.raises(InputError, match=r"task 'mood': the labels '\U0001f600' and '\U0001f622'"):
        ev.zero_shot_heads(backbone, [_task("mood", ["\U0001f600", "\U0001f622"])])
    with pytest.raises(InputError, match="labels 'Good' and 'good'"):
        ev.zero_shot_heads(backbone, [_task("case", ["Good", "good"])])
    heads = ev.zero_shot_heads(backbone, [_task("ok", ["good", "bad"])])
    assert heads[0].vectors.shape[0] == 2
