"""The streamed merge's per-chunk progress: ``nu.merge_adapters_streaming(progress=...)`` is
called once per chunk read (its total announced first, from the plan of chunks), and
``netutility merge``'s bar advances once per chunk; neither changes the merge."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import safetensors.numpy as st

import netutility_jax as nu
from netutility_jax.cli import entry
from netutility_jax.cli import merge as cli_merge
from netutility_jax.errors import InputTypeError

LAYERS = 4
# one module's factors, every task (3 x r 4 x (32 + 16) float32 = 2304 bytes): a module a chunk
CHUNK = 4096


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> list[pathlib.Path]:
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("progress")
    out = []
    for t in range(3):
        ad = {
            f"model.layers.{i}.self_attn.q_proj": {
                "lora_a": rng.normal(size=(32, 4)).astype(np.float32),
                "lora_b": rng.normal(size=(4, 16)).astype(np.float32),
                "scale": 2.0,
            }
            for i in range(LAYERS)
        }
        p = root / f"task{t}"
        nu.peft.save_adapter(ad, p)
        out.append(p)
    return out


class _CountingSource:
    """An AdapterSet whose chunk reads are counted (what the progress must follow)."""

    def __init__(self, source):
        self._source, self.reads = source, 0
        self.names, self.shapes = source.names, source.shapes
        self.paths, self.stored_dtypes = source.paths, source.stored_dtypes
        self.config = source.config

    def read(self, names, **kw):
        self.reads += 1
        return self._source.read(names, **kw)


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(
        np.array_equal(np.asarray(a[n][k]), np.asarray(b[n][k]))
        for n in a
        for k in ("lora_a", "lora_b")
    )


@pytest.mark.parametrize(
    "settings, passes",
    [
        pytest.param(  # scoring pass, merge pass
            {"budget": 4, "method": "ta", "space": "core"}, 2, marks=pytest.mark.slow
        ),
        ({"method": "tsv", "space": "core", "allocation": "all"}, 1),  # merge pass only
        # model-wide TIES: scoring, the common unit, two 16-bit radix passes (float32), merging
        ({"budget": 4, "method": "ties", "space": "core", "trim_scope": "model"}, 5),
    ],
)
def test_progress_once_per_chunk_read(paths, settings, passes):
    calls: list[tuple[int, int, int]] = []
    source = _CountingSource(nu.peft.open_adapters(paths))

    def progress(done: int, total: int) -> None:
        calls.append((done, total, source.reads))

    out, rep = nu.merge_adapters_streaming(source, chunk_bytes=CHUNK, progress=progress, **settings)
    total = LAYERS * passes  # one chunk per module (the chunk size fits one module)
    assert source.reads == total
    # announced before any read, then one call per chunk, each after its own read
    assert calls == [(0, total, 0)] + [(d, total, d) for d in range(1, total + 1)]
    ref, ref_rep = nu.merge_adapters_streaming(
        nu.peft.open_adapters(paths), chunk_bytes=CHUNK, **settings
    )
    assert _same(out, ref)
    assert rep.ranks == ref_rep.ranks


def test_progress_must_be_callable(paths):
    with pytest.raises(InputTypeError, match="progress is a int; expected None or a function"):
        nu.merge_adapters_streaming(nu.peft.open_adapters(paths), budget=4, progress=3)


class _FakeBar:
    """What ``netutility merge`` uses of a tqdm bar, recorded."""

    def __init__(self, total: int):
        self.total, self.n, self.updates, self.postfix = total, 0, [], []

    def update(self, k: int = 1) -> None:
        self.n += k
        self.updates.append(k)

    def set_postfix_str(self, s: str) -> None:
        self.postfix.append(s)

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_cli_bar_advances_per_chunk(paths, tmp_path, monkeypatch):
    bars: list[_FakeBar] = []

    def fake_progress(total, desc, quiet):
        if quiet:
            return None
        bars.append(_FakeBar(total))
        return bars[-1]

    monkeypatch.setattr(cli_merge, "progress", fake_progress)
    monkeypatch.setenv("NETUTILITY_COMPILE_CACHE", "off")
    common = ["merge", *map(str, paths), "--budget", "4", "--space", "core", "--no-plots"]
    # --chunk-mb in MiB: CHUNK bytes, so that every module is its own chunk
    chunk = ["--chunk-mb", repr(CHUNK / 2**20)]
    assert entry.main([*common, *chunk, "--out", str(tmp_path / "bar")]) == 0
    assert entry.main([*common, *chunk, "--out", str(tmp_path / "quiet"), "--quiet"]) == 0
    assert len(bars) == 1  # --quiet: no bar
    bar = bars[0]
    reads = 2 * LAYERS  # scoring and merging, one chunk per module
    steps = 5  # opened, merged and written, saved adapter, wrote report, done (no plots)
    assert bar.total == steps + reads
    assert bar.n == bar.total and bar.updates == [1] * bar.total
    chunk_lines = [s for s in bar.postfix if ": chunk " in s]
    assert chunk_lines[-1].endswith(f"chunk {reads} of {reads}")
    assert len(chunk_lines) == reads + 1  # the announcement, then one per chunk
    # the bar changes nothing: the same adapter, bit for bit, with and without it
    a = st.load_file(str(tmp_path / "bar" / "adapter_model.safetensors"))
    b = st.load_file(str(tmp_path / "quiet" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
