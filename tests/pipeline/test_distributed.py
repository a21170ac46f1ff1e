"""Merging with several processes (``netutility merge --distributed``, ``netutility_jax.pipeline._exchange``).

Real processes on localhost (``jax.distributed`` on CPU, collectives over gloo) run the same
command; their output is compared with the one-process command's on the same PEFT folders:
the same ``adapter_model.safetensors`` byte for byte and the same config (each chunk is merged by
the same code whichever process reads it, and the global statistics cross the processes bit for
bit). A process whose chunk fails must stop every process, each with a one-line error. The pytest
process itself never joins a distributed run (the refusals tested in it come before joining).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import safetensors.numpy

import netutility_jax as nu
from netutility_jax import cli, peft
from netutility_jax.cli import check_adapter_dir
from netutility_jax.errors import InputError
from netutility_jax.pipeline import _exchange

# the index of a sharded safetensors checkpoint (transformers and PEFT name it so)
SHARD_INDEX = "adapter_model.safetensors.index.json"

LAYERS = 6
RANKS = (4, 4, 3)  # task 2: rank 3, and it lacks the last layer
BAD = "model.layers.2.self_attn.q_proj"  # the module made non-finite in test_a_failing_process
COMMON = ["--budget", "3", "--no-plots", "--quiet", "--chunk-mb", "0.001"]  # a module a chunk
TIMEOUT = 240  # seconds for every process of one run


def _adapter(rng: np.random.Generator, task: int) -> dict:
    ad = {}
    for layer in range(LAYERS - (task == 2)):
        r = RANKS[task]
        a = rng.normal(size=(16, r)) / 4
        b = rng.normal(size=(r, 16)) * (0.7 ** np.arange(r))[:, None] * (1.0 + 0.6 * task)
        ad[f"model.layers.{layer}.self_attn.q_proj"] = {"lora_a": a, "lora_b": b, "scale": 1.0}
    return ad


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("distributed")
    rng = np.random.default_rng(3)
    out = []
    for i in range(len(RANKS)):
        nu.peft.save_adapter(_adapter(rng, i), root / f"task{i}", base_model_name_or_path="org/b")
        out.append(str(root / f"task{i}"))
    return out


def _env() -> dict[str, str]:
    """The children's environment: no compilation cache (as conftest), one CPU device each."""
    env = {**os.environ, "NETUTILITY_COMPILE_CACHE": "off", "JAX_PLATFORMS": "cpu"}
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags.strip()
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _distributed(n: int, argv: list[str], tmp: pathlib.Path, per_process=None) -> list[tuple]:
    """``netutility merge ARGV --distributed`` in ``n`` processes on localhost; ``[(exit code,
    stdout, stderr)]`` per process. ``per_process(i)`` replaces the argv of process ``i``. Every
    process is killed if the run takes longer than ``TIMEOUT`` or one has failed for 60 s."""
    port = _free_port()
    procs, logs = [], []
    for i in range(n):
        args = argv if per_process is None else per_process(i)
        cmd = [sys.executable, "-m", "netutility_jax.cli", "merge", *args, "--distributed",
               "--coordinator", f"localhost:{port}", "--num-processes", str(n),
               "--process-id", str(i)]  # fmt: skip
        out, err = open(tmp / f"p{i}.out", "w+"), open(tmp / f"p{i}.err", "w+")
        logs.append((out, err))
        procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=_env()))
    start, failed_at = time.monotonic(), None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now
            if now - start > TIMEOUT or (failed_at is not None and now - failed_at > 60):
                pytest.fail(f"the {n} processes did not all finish: {_logs(logs)}")
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    result = []
    for p, (out, err) in zip(procs, logs, strict=True):
        out.seek(0), err.seek(0)
        result.append((p.returncode, out.read(), _no_gloo(err.read())))
        out.close(), err.close()
    return result


def _logs(logs) -> str:
    parts = []
    for i, (_, err) in enumerate(logs):
        err.seek(0)
        parts.append(f"process {i}: {_no_gloo(err.read())[-2000:]}")
    return " | ".join(parts)


def _no_gloo(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("[Gloo]"))


def _one_process(argv: list[str]) -> threading.Thread:
    """The one-process command in this process, in a thread (while the children run)."""
    outcome: list = []
    t = threading.Thread(target=lambda: outcome.append(cli.main(["merge", *argv])))
    t.outcome = outcome  # type: ignore[attr-defined]
    t.start()
    return t


def _assert_same_folder(got: pathlib.Path, ref: pathlib.Path, processes: int) -> None:
    """The distributed output is the one-process output: the same adapter file, byte for byte,
    the same config, the same report but for the number of processes."""
    assert (got / peft.WEIGHTS_NAME).read_bytes() == (ref / peft.WEIGHTS_NAME).read_bytes()
    assert (got / peft.CONFIG_NAME).read_text() == (ref / peft.CONFIG_NAME).read_text()
    rep, ref_rep = (json.loads((d / cli.REPORT_NAME).read_text()) for d in (got, ref))
    assert (rep["options"].pop("processes"), ref_rep["options"].pop("processes")) == (processes, 1)
    rep.pop("created_utc"), ref_rep.pop("created_utc")  # (each run records its own time)
    assert rep == ref_rep
    assert sorted(os.listdir(got)) == sorted(os.listdir(ref))


def _run_both(n, argv, folders, tmp_path, capsys, extra=()) -> tuple[pathlib.Path, ...]:
    """The same merge by ``n`` processes (with ``extra`` flags) and by one (in this process,
    meanwhile)."""
    dist, ref = tmp_path / "dist", tmp_path / "ref"
    one = _one_process([*folders, *COMMON, *argv, "--out", str(ref)])
    runs = _distributed(n, [*folders, *COMMON, *argv, *extra, "--out", str(dist)], tmp_path)
    one.join(TIMEOUT)
    assert one.outcome == [0], capsys.readouterr().err  # type: ignore[attr-defined]
    for i, (rc, out, err) in enumerate(runs):
        assert rc == 0, f"process {i}: {err}"
        assert ("merged 3 adapters" in out) == (i == 0)  # process 0 prints the summary
    capsys.readouterr()
    return dist, ref


# ------------------------------------------------------------------------------ the exchange


def test_pack_and_assign():
    arrays = {
        "zero-d": np.asarray(7, np.int64),
        "mask": np.array([[True, False]]),
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::2],  # not contiguous
        "empty": np.zeros((0, 3)),
        "name/with\0odd chars": np.asarray([1.5]),
    }
    back = _exchange.unpack(_exchange.pack(arrays))
    assert list(back) == list(arrays)
    for k, a in arrays.items():
        assert back[k].dtype == a.dtype and back[k].shape == a.shape
        np.testing.assert_array_equal(back[k], a)
    with pytest.raises(TypeError, match="does not travel"):
        _exchange.pack({"x": np.array([object()])})
    # chunks, largest first, to the least loaded process: balanced and the same every time
    weights = [5, 1, 4, 3, 3, 2]
    owner = _exchange.assign(weights, 2)
    assert owner == _exchange.assign(weights, 2) == (0, 0, 1, 1, 0, 1)
    loads = [sum(w for w, p in zip(weights, owner, strict=True) if p == q) for q in (0, 1)]
    assert loads == [9, 9]
    assert _exchange.assign(weights, 1) == (0,) * 6
    assert _exchange.assign([1], 4) == (0,)  # more processes than chunks: some have none


# ----------------------------------------------------------------------------- the command


def test_two_processes_write_what_one_process_writes(folders, tmp_path, capsys):
    """2 processes (TA in Core space, lambda and alpha 'auto', ragged ranks and a module one
    task lacks): the adapter file byte for byte, the config and the report as one process."""
    dist, ref = _run_both(2, ["--space", "core"], folders, tmp_path, capsys)
    _assert_same_folder(dist, ref, 2)
    assert not [f for f in os.listdir(tmp_path) if "staging" in f]


def test_one_process_exchange_is_the_plain_merge(folders):
    """``distributed=True`` with one process (no jax.distributed here) is the plain streamed
    merge, array for array; the exchange of one process raises the work's own error."""
    src = peft.open_adapters(folders)
    kw = {"budget": 3, "space": "core", "alpha": "auto", "chunk_bytes": 1000}
    got, rep = nu.merge_adapters_streaming(src, distributed=True, **kw)
    ref, ref_rep = nu.merge_adapters_streaming(src, **kw)
    assert list(got) == list(ref) == list(src.names)
    for n in ref:
        for k in ("lora_a", "lora_b"):
            np.testing.assert_array_equal(np.asarray(got[n][k]), np.asarray(ref[n][k]))
    assert rep.ranks == ref_rep.ranks and rep.lam == ref_rep.lam and rep.alpha == ref_rep.alpha
    assert rep.heterogeneity == ref_rep.heterogeneity
    with pytest.raises(nu.errors.InputTypeError, match="distributed='yes'"):
        nu.merge_adapters_streaming(src, distributed="yes", **kw)

    def fail():
        raise KeyError("mine")

    with pytest.raises(KeyError, match="mine"):
        _exchange.LOCAL.allgather("f", fail)


def test_a_failing_process_stops_every_process(folders, tmp_path):
    """A chunk that fails (non-finite factors in one module, found by the process that reads
    it) stops both processes with one line each: the failing one its own error, the other
    naming it; nothing is written."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / peft.CONFIG_NAME).write_bytes((pathlib.Path(folders[1]) / peft.CONFIG_NAME).read_bytes())
    tensors = safetensors.numpy.load_file(str(pathlib.Path(folders[1]) / peft.WEIGHTS_NAME))
    key = f"{peft.PREFIX}{BAD}.lora_B.weight"
    tensors[key] = np.full_like(tensors[key], np.nan)
    safetensors.numpy.save_file(tensors, str(bad / peft.WEIGHTS_NAME))
    paths = [folders[0], str(bad), folders[2]]
    runs = _distributed(2, [*paths, *COMMON, "--out", str(tmp_path / "out")], tmp_path)
    assert [rc for rc, _, _ in runs] == [2, 2]
    errors = [[ln for ln in err.splitlines() if ": error: " in ln] for _, _, err in runs]
    assert [len(e) for e in errors] == [1, 1], errors
    lines = [e[0] for e in errors]
    own = [i for i, line in enumerate(lines) if "of 2 failed:" not in line]
    assert len(own) == 1, lines  # exactly one process read the bad module
    p = own[0]
    assert re.match(r"netutility merge: error: .*non-finite", lines[p]), lines[p]
    message = lines[p].removeprefix("netutility merge: error: ")
    other = lines[1 - p]
    fn = "nu.merge_adapters_streaming"
    assert other == f"netutility merge: error: {fn}: process {p} of 2 failed: {message}"
    assert not (tmp_path / "out").exists()
    assert not [f for f in os.listdir(tmp_path) if "staging" in f]
    # a process that cannot even open its inputs stops the others just as well
    missing = str(tmp_path / "missing")
    runs = _distributed(
        2, [], tmp_path, lambda i: [*folders[:2], missing if i else folders[2], *COMMON, "--out",
                                    str(tmp_path / "out")],
    )  # fmt: skip
    assert [rc for rc, _, _ in runs] == [2, 2]
    own = f"adapter folder {missing} does not exist"
    assert own in runs[1][2] and "of 2 failed:" not in runs[1][2]
    assert f"netutility merge: process 1 of 2 failed: {own}" in runs[0][2]


def test_scores_beyond_float32_stop_every_process_after_alpha_is_chosen(folders, tmp_path):
    """--alpha auto (the default) scores both geometries before h picks one, so a result beyond
    float32 is refused only after the exchange: by the process whose chunk holds it, with the
    one-process message, and the other names it; no process waits for ever."""
    big = tmp_path / "big"
    big.mkdir()
    (big / peft.CONFIG_NAME).write_bytes((pathlib.Path(folders[1]) / peft.CONFIG_NAME).read_bytes())
    tensors = safetensors.numpy.load_file(str(pathlib.Path(folders[1]) / peft.WEIGHTS_NAME))
    key = f"{peft.PREFIX}{BAD}.lora_B.weight"
    tensors[key] = tensors[key] * np.float32(1e25)  # interference about 1e50
    safetensors.numpy.save_file(tensors, str(big / peft.WEIGHTS_NAME))
    paths = [folders[0], str(big), folders[2]]
    with pytest.raises(InputError, match="interference") as one:
        nu.merge_adapters(peft.load_adapters(paths).adapters, budget=3, alpha="auto")
    runs = _distributed(2, [*paths, *COMMON, "--out", str(tmp_path / "out")], tmp_path)
    assert [rc for rc, _, _ in runs] == [2, 2]
    lines = [next(ln for ln in err.splitlines() if ": error: " in ln) for _, _, err in runs]
    own = [i for i, line in enumerate(lines) if "of 2 failed:" not in line]
    assert len(own) == 1, lines
    p = own[0]
    # the owner's words are the in-memory error's (one module affected: the same count too)
    assert lines[p] == f"netutility merge: error: {one.value}", lines[p]
    fn = "nu.merge_adapters_streaming"
    assert lines[1 - p] == f"netutility merge: error: {fn}: process {p} of 2 failed: {one.value}"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--distributed", "--in-memory"], "--in-memory cannot be used with --distributed"),
        (["--keep-shards"], "--keep-shards applies only with --distributed"),
        (["--coordinator", "h:1"], "--coordinator applies only with --distributed"),
        (["--heartbeat-timeout", "5"], "--heartbeat-timeout applies only with --distributed"),
        (["--distributed", "--num-processes", "2", "--process-id", "2"], "indices run from 0 to 1"),
        (["--distributed", "--method", "ties", "--density", "0.5", "--trim-scope", "model"],
         "model-wide TIES .* cannot run with --distributed"),
    ],
)  # fmt: skip
def test_distributed_flags_are_refused_before_joining(folders, tmp_path, capsys, argv, message):
    rc = cli.main(["merge", *folders, "--budget", "2", "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("change", "what"),
    [
        (lambda argv, folders: [*argv, "--method", "tsv"], "--method"),
        (lambda argv, folders: [folders[0], folders[1], folders[0], *argv[3:]], "adapter 3"),
    ],
    ids=["method", "adapter"],
)
def test_processes_given_different_inputs_all_stop_before_merging(folders, tmp_path, change, what):
    argv = [*folders, *COMMON, "--out", str(tmp_path / "out")]
    runs = _distributed(2, argv, tmp_path, lambda i: argv if i == 0 else change(argv, folders))
    for i, (rc, _, err) in enumerate(runs):
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1, f"process {i}: {err}"
        assert "the 2 processes were given different " + what in lines[0], lines[0]
        assert "process 0:" in lines[0] and "process 1:" in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_process_whose_peers_never_come_gives_up_in_one_line(folders, tmp_path):
    port = _free_port()
    cmd = [sys.executable, "-m", "netutility_jax.cli", "merge", *folders, *COMMON, "--out",
           str(tmp_path / "out"), "--distributed", "--coordinator", f"localhost:{port}",
           "--num-processes", "2", "--process-id", "0", "--distributed-timeout", "3"]  # fmt: skip
    start = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=TIMEOUT)
    lines = _no_gloo(r.stderr).strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "did not all join within 3 s" in lines[0] and "--distributed-timeout" in lines[0]
    assert time.monotonic() - start < 60
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--coordinator", "localhost"], "--coordinator: the coordinator address must be HOST:PORT"),
        (["--coordinator", "localhost:99999"], "port in 1..65535"),
        (["--coordinator", "no-such-host.invalid:80"], "cannot be resolved"),
        (["--distributed-timeout", "0"], "--distributed-timeout: expected a finite number in"),
        (["--heartbeat-timeout", "0.5"], "--heartbeat-timeout: expected a finite number in"),
    ],
)  # fmt: skip
def test_coordinator_and_timeout_are_refused_before_joining(
    folders, tmp_path, capsys, argv, message
):
    try:
        rc = cli.main(["merge", *folders, "--budget", "2", "--out", str(tmp_path / "o"),
                       "--distributed", *argv])  # fmt: skip
    except SystemExit as e:  # (argparse's refusals of a flag's value)
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert message in err, err


def _shard(folder: pathlib.Path, out: pathlib.Path, index: dict | None = None) -> dict:
    """``folder``'s adapter rewritten as two shards and an index in ``out``."""
    out.mkdir()
    (out / peft.CONFIG_NAME).write_bytes((folder / peft.CONFIG_NAME).read_bytes())
    tensors = safetensors.numpy.load_file(str(folder / peft.WEIGHTS_NAME))
    keys = sorted(tensors)
    files = {}
    for j, part in enumerate((keys[::2], keys[1::2])):
        name = f"adapter_model-{j + 1:05d}-of-00002.safetensors"
        safetensors.numpy.save_file({k: tensors[k] for k in part}, str(out / name))
        files.update(dict.fromkeys(part, name))
    index = {"metadata": {}, "weight_map": files} if index is None else index
    (out / SHARD_INDEX).write_text(json.dumps(index))
    return files


def test_a_sharded_adapter_reads_like_one_file(folders, tmp_path):
    """A folder of shards and an index (what --keep-shards writes) loads, opens and inspects
    as the single file it was cut from; a broken index is refused with its file named."""
    src = pathlib.Path(folders[2])
    files = _shard(src, tmp_path / "sharded")
    one, sharded = peft.load_adapter(src), peft.load_adapter(tmp_path / "sharded")
    assert list(one) == list(sharded)
    for n in one:
        assert one[n]["scale"] == sharded[n]["scale"]
        for k in ("lora_a", "lora_b"):
            np.testing.assert_array_equal(np.asarray(one[n][k]), np.asarray(sharded[n][k]))
    opened = peft.open_adapters([tmp_path / "sharded", src])
    got = opened.read(opened.names)
    for n in one:
        np.testing.assert_array_equal(np.asarray(got[0][n]["lora_b"]), np.asarray(one[n]["lora_b"]))
    assert peft.weight_shapes(tmp_path / "sharded") == peft.weight_shapes(src)
    check_adapter_dir(str(tmp_path / "sharded"))
    lost = dict(files)
    key = next(iter(lost))
    lost[key] = next(f for f in set(files.values()) if f != files[key])  # the other shard
    _shard(src, tmp_path / "lost", {"weight_map": lost})
    with pytest.raises(InputError, match="does not hold it"):
        peft.load_adapter(tmp_path / "lost")
    _shard(src, tmp_path / "escape", {"weight_map": {key: "../x.safetensors"}})
    with pytest.raises(InputError, match="a shard file in the same folder"):
        peft.load_adapter(tmp_path / "escape")


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [
        ["--method", "dare", "--space", "core", "--p", "0.5", "--seed", "7"],
        ["--method", "ties", "--space", "knots", "--density", "0.5"],
        ["--method", "tsv", "--space", "full", "--alpha", "0", "--lam", "0.5",
         "--serving-ranks", "vllm", "--dtype", "bfloat16"],
        ["--method", "ties", "--space", "full", "--density", "0.4", "--rank", "2",
         "--allocation", "all"],
    ],
    ids=["dare-core", "ties-knots", "tsv-serving", "ties-full-all"],
)  # fmt: skip
def test_three_processes_match_one_for_every_method(folders, tmp_path, capsys, argv):
    """DARE (its random masks keyed by each module's global position), TIES in KnOTS space, a
    fixed alpha and lambda with a serving rank, and a dense method truncated chunk by chunk
    with no budget: 3 processes write the one-process folder."""
    dist, ref = _run_both(3, argv, folders, tmp_path, capsys)
    _assert_same_folder(dist, ref, 3)


@pytest.mark.slow
def test_four_processes_keep_shards(folders, tmp_path, capsys):
    """4 processes with --keep-shards (a uniform serving rank, bf16): one shard per process and
    the index, the one-process config, and the same tensors through nu.peft.load_adapters and
    netutility inspect."""
    argv = ["--space", "core", "--serving-ranks", "8,16", "--dtype", "bfloat16"]
    dist, ref = _run_both(4, argv, folders, tmp_path, capsys, ["--keep-shards"])
    index = json.loads((dist / SHARD_INDEX).read_text())
    shards = sorted(f for f in os.listdir(dist) if f.startswith("adapter_model-"))
    assert shards == [f"adapter_model-{i:05d}-of-00004.safetensors" for i in (1, 2, 3, 4)]
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(
        a.nbytes for a in safetensors.numpy.load_file(str(ref / peft.WEIGHTS_NAME)).values()
    )
    assert not (dist / peft.WEIGHTS_NAME).exists()
    assert (dist / peft.CONFIG_NAME).read_text() == (ref / peft.CONFIG_NAME).read_text()
    assert json.loads((dist / peft.CONFIG_NAME).read_text())["r"] == 8
    got, want = peft.load_adapters([dist]).adapters[0], peft.load_adapters([ref]).adapters[0]
    assert list(got) == list(want)
    for n in want:
        assert got[n]["scale"] == want[n]["scale"]
        for k in ("lora_a", "lora_b"):
            np.testing.assert_array_equal(np.asarray(got[n][k]), np.asarray(want[n][k]))
    assert cli.main(["inspect", str(dist), str(ref), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tasks"][0] == {**info["tasks"][1], "adapter": str(dist)}


def test_a_peer_killed_mid_run_ends_the_other_in_one_line_at_once(folders, tmp_path):
    """Process 1 is killed (SIGKILL, its whole session) once process 0 is merging chunks: process
    0 ends with status 2 and one line saying another process stopped, within seconds (not a Gloo
    traceback and an 'internal error', nor JAX's shutdown barrier waiting for the dead one), and
    writes nothing."""
    port = _free_port()
    procs, errs = [], []
    for i in range(2):
        cmd = [sys.executable, "-m", "netutility_jax.cli", "merge", *folders, "--budget", "3",
               "--no-plots", "--chunk-mb", "0.001", "--out", str(tmp_path / "out"),
               "--distributed", "--coordinator", f"localhost:{port}", "--num-processes", "2",
               "--process-id", str(i), "--heartbeat-timeout", "10"]  # fmt: skip
        errs.append(open(tmp_path / f"p{i}.err", "w+"))
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=errs[i], text=True,
                                      env=_env(), start_new_session=True))  # fmt: skip
    try:
        start = time.monotonic()
        # the progress bar (on stderr) names the merging step: both processes have joined and
        # opened their inputs, and exchanges remain (the score pass, every chunk)
        while "scoring and merging" not in (tmp_path / "p0.err").read_text():
            assert procs[0].poll() is None, (tmp_path / "p0.err").read_text()
            assert time.monotonic() - start < TIMEOUT, "process 0 never reached its chunks"
            time.sleep(0.02)
        os.killpg(procs[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        rc = procs[0].wait(timeout=60)
        took = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in errs:
            f.close()
    err = (tmp_path / "p0.err").read_text()
    lines = [ln for ln in re.split(r"[\r\n]", _no_gloo(err)) if ln.strip() and "%|" not in ln]
    # the merge's own notes (the fixture's tasks target different modules), then one error
    lines = [ln for ln in lines if not ln.startswith("netutility merge: note: ")]
    assert rc == 2 and len(lines) == 1, err
    assert re.match(
        r"netutility merge: error: (nu\.merge_adapters_streaming|netutility merge): another "
        r"process of the distributed run \(2 processes\) stopped during an exchange", lines[0]
    ), lines[0]  # fmt: skip
    assert took < 30, took  # the exchange fails at once; at worst the heartbeat (10 s) ends it
    assert not (tmp_path / "out").exists()
