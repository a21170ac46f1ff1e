"""Reading ``torch.save`` files without torch (``nu.peft._torch_pickle``), PEFT folders that hold
the pickled ``adapter_model.bin`` wherever a safetensors folder works (``load_adapter``,
``open_adapters``, ``netutility merge`` / ``inspect``), ``netutility convert``, and hostile
pickles: each is an ``InputError`` naming the file, and nothing in it runs.

Real files come from real ``torch.save`` and PEFT's ``save_pretrained(safe_serialization=False)``;
hostile ones are pickles written opcode by opcode (or by ``pickle.dumps`` of an object whose
``__reduce__`` calls ``os.system``) inside a zip laid out as ``torch.save`` lays it out.
"""

from __future__ import annotations

import copy
import doctest
import hashlib
import json
import os
import pathlib
import pickle
import re
import struct
import subprocess
import warnings
import zipfile

import ml_dtypes
import numpy as np
import pytest

from netutility_jax import cli
from netutility_jax import peft as nu_peft
from netutility_jax.errors import InputError
from netutility_jax.peft._torch_pickle import TorchArchive

torch = pytest.importorskip("torch", reason="the files under test are written by torch.save")
safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="nu.peft needs safetensors")

FN = "reader"
HF_WARNINGS = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)


def _read(path) -> dict[str, np.ndarray]:
    with TorchArchive(path, fn=FN) as a:
        return {k: a.read(k) for k in a.keys()}


def _exact(t) -> np.ndarray:
    """A torch tensor as the numpy array it should read as (same dtype, same bits)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        kind = ml_dtypes.float8_e4m3fn if t.dtype == torch.float8_e4m3fn else ml_dtypes.float8_e5m2
        return t.view(torch.uint8).numpy().view(kind)
    return t.numpy()


def _assert_same(got: np.ndarray, want, what: str = "") -> None:
    w = _exact(want)
    assert got.dtype == w.dtype, (what, got.dtype, w.dtype)
    assert got.shape == w.shape, (what, got.shape, w.shape)
    assert got.tobytes() == w.tobytes(), what  # bit for bit (C order both)
    assert got.flags.c_contiguous and got.flags.writeable, what


# ---------------------------------------------------------------------------------------------
# Real torch.save files
# ---------------------------------------------------------------------------------------------

FLOAT_DTYPES = ["float32", "float16", "bfloat16", "float64"]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_each_float_dtype_reads_bit_for_bit(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    sd = {
        "base_model.model.q.lora_A.weight": torch.randn(4, 7, generator=g).to(
            getattr(torch, dtype)
        ),
        "base_model.model.q.lora_B.weight": torch.randn(5, 4, generator=g).to(
            getattr(torch, dtype)
        ),
        "tiny": torch.tensor([1e-30, -0.0, float("inf"), 3.5]).to(getattr(torch, dtype)),
    }
    f = tmp_path / "adapter_model.bin"
    torch.save(sd, f)
    got = _read(f)
    assert list(got) == list(sd)  # the file's order
    for k, t in sd.items():
        _assert_same(got[k], t, k)
    with TorchArchive(f, fn=FN) as a:
        code = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}[dtype]
        assert {i.code for i in a.tensors.values()} == {code}


def test_views_shared_storages_offsets_strides_empty_and_scalar(tmp_path):
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    lin = torch.nn.Linear(3, 2)
    sd = {
        "t": t,
        "tail": t[1:],  # the same storage, offset 6
        "transposed": t.t(),  # strides (1, 6)
        "every_other": t[:, ::2],  # strides (6, 2)
        "offset_and_strided": t[1:, 1::3],  # offset 7, strides (6, 3)
        "column": t[:, 5],  # 1-D, offset 5, stride 6
        "empty": torch.zeros(0, 5),
        "empty_view": t[:, 6:],  # a (4, 0) view at the end of the storage
        "scalar": torch.tensor(2.5),
        "scalar_view": t[2, 3],  # 0-d, offset 15
        "parameter": lin.weight,  # _rebuild_parameter, requires_grad=True
        "needs_grad": torch.ones(3, requires_grad=True),
    }
    lin.weight.register_hook(lambda g: g)  # a backward hook on a saved parameter: ignored
    f = tmp_path / "views.bin"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch warns that hooks are not serialized)
        torch.save(sd, f)
    got = _read(f)
    for k, v in sd.items():
        _assert_same(got[k], v, k)
    with TorchArchive(f, fn=FN) as a:
        info = a.tensors
        shared = {info[k].storage for k in ("t", "tail", "transposed", "every_other", "column")}
        assert len(shared) == 1  # one storage, viewed five ways
        assert (info["tail"].offset, info["transposed"].stride) == (6, (1, 6))
        assert (info["offset_and_strided"].offset, info["offset_and_strided"].stride) == (7, (6, 3))
        assert info["scalar"].shape == () and info["empty"].shape == (0, 5)
    # every read is its own copy: writing one does not change another
    got["t"][0, 0] = -1.0
    assert _read(f)["transposed"][0, 0] == 0.0 and got["transposed"][0, 0] == 0.0


def test_state_dict_with_metadata_and_other_dtypes(tmp_path):
    lin = torch.nn.Linear(3, 2)  # an OrderedDict whose _metadata is set by BUILD
    f = tmp_path / "sd.bin"
    torch.save(lin.state_dict(), f)
    got = _read(f)
    assert list(got) == ["weight", "bias"]
    _assert_same(got["weight"], lin.weight)
    # dtypes without a typed storage class go through _rebuild_tensor_v3 and UntypedStorage
    other = {
        "u16": torch.arange(5, dtype=torch.int32).to(torch.uint16),
        "f8": torch.tensor([0.5, -2.0, 448.0]).to(torch.float8_e4m3fn),
        "i64": torch.arange(3),
        "mask": torch.tensor([True, False]),
    }
    torch.save(other, tmp_path / "other.bin")
    got = _read(tmp_path / "other.bin")
    for k, v in other.items():
        _assert_same(got[k], v, k)


def _rewrite_zip(src: pathlib.Path, dst: pathlib.Path, edit) -> None:
    """``dst``: the entries of ``src`` through ``edit(name, data) -> (name, data) | None``."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            out = edit(info.filename, zin.read(info))
            if out is not None:
                zout.writestr(out[0], out[1])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_any_top_folder_and_big_endian_storages(tmp_path, dtype):
    t = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).to(getattr(torch, dtype))
    f = tmp_path / "little.bin"
    torch.save({"w": t, "v": t[1:, ::2]}, f)
    size = t.element_size()

    def to_big(name: str, data: bytes):
        name = "some other name/" + name.split("/", 1)[1]
        if name.endswith("/byteorder"):
            return name, b"big"
        if "/data/" in name:
            return name, np.frombuffer(data, f"<u{size}").byteswap().tobytes()
        return name, data

    big = tmp_path / "big.bin"
    _rewrite_zip(f, big, to_big)
    got = _read(big)
    _assert_same(got["w"], t)
    _assert_same(got["v"], t[1:, ::2])


def test_docstring_example():
    from netutility_jax.peft import _torch_pickle

    res = doctest.testmod(_torch_pickle, optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0


def test_no_plain_unpickling_of_the_file(tmp_path, monkeypatch):
    """Only the restricted unpickler reads the pickle: pickle.load / loads are never called."""

    def refuse(*args, **kwargs):
        raise AssertionError("plain pickle.load(s) called on the file")

    f = tmp_path / "x.bin"
    torch.save({"w": torch.ones(2, 2)}, f)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    assert _read(f)["w"].tolist() == [[1.0, 1.0], [1.0, 1.0]]


# ---------------------------------------------------------------------------------------------
# Real PEFT adapters saved as adapter_model.bin: the same adapter as the safetensors save
# ---------------------------------------------------------------------------------------------


def _tiny_llama():
    transformers = pytest.importorskip("transformers", reason="needs transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def peft_folders(tmp_path_factory):
    """``{(format, dtype, task): folder}``: two tasks' LoRAs (r=4 on q_proj, v_proj, nonzero
    lora_B) of a tiny random Llama, each saved by PEFT as safetensors and as the pickled bin, in
    float32 and bfloat16."""
    peft = pytest.importorskip("peft", reason="needs peft")
    base = _tiny_llama()
    root = tmp_path_factory.mktemp("peft")
    out = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)  # (transformers' deprecations)
        for task in range(2):
            lc = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
            pm = peft.get_peft_model(copy.deepcopy(base), lc)
            g = torch.Generator().manual_seed(task)
            with torch.no_grad():
                for name, p in pm.named_parameters():
                    if "lora_" in name:
                        p.copy_(torch.randn(p.shape, generator=g) / 4)
            for dtype in ("float32", "bfloat16"):
                pm = pm.to(getattr(torch, dtype))
                for fmt, safe in (("safetensors", True), ("bin", False)):
                    d = root / f"{fmt}-{dtype}-{task}"
                    pm.save_pretrained(str(d), safe_serialization=safe)
                    out[fmt, dtype, task] = d
    for (fmt, _, _), d in out.items():
        names = {p.name for p in d.iterdir()}
        other = {"safetensors": "adapter_model.bin", "bin": "adapter_model.safetensors"}[fmt]
        assert "adapter_config.json" in names and other not in names, names
    return out


def _assert_adapters_equal(got, want) -> None:
    assert list(got) == list(want)
    for name in want:
        if want[name] is None:
            assert got[name] is None, name
            continue
        assert got[name]["scale"] == want[name]["scale"], name
        for f in ("lora_a", "lora_b"):
            a, b = np.asarray(got[name][f]), np.asarray(want[name][f])
            assert a.dtype == b.dtype and np.array_equal(a, b), (name, f)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_peft_bin_loads_as_its_safetensors_save(peft_folders, dtype):
    st, pk = peft_folders["safetensors", dtype, 0], peft_folders["bin", dtype, 0]
    got, want = nu_peft.load_adapter(pk), nu_peft.load_adapter(st)
    assert len(want) == 4  # 2 layers x (q_proj, v_proj)
    assert any(np.abs(np.asarray(m["lora_b"])).max() > 0 for m in want.values())
    _assert_adapters_equal(got, want)
    # opened lazily (a merge streamed from disk): the same checks, the same modules
    s_pk = nu_peft.open_adapters([peft_folders["bin", dtype, t] for t in range(2)])
    s_st = nu_peft.open_adapters([peft_folders["safetensors", dtype, t] for t in range(2)])
    assert s_pk.names == s_st.names and s_pk.shapes == s_st.shapes
    assert (
        s_pk.stored_dtypes == s_st.stored_dtypes == (("BF16",) if dtype == "bfloat16" else ("F32",))
    )
    assert s_pk.nbytes == s_st.nbytes
    for a, b in zip(s_pk.read(s_pk.names), s_st.read(s_st.names), strict=True):
        _assert_adapters_equal(a, b)
    # the command's size estimate reads the bin's shapes too
    assert cli.weight_shapes(pk) == cli.weight_shapes(st)


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@HF_WARNINGS
@pytest.mark.parametrize(
    "mode",
    # (~15 s each; load_adapter and inspect on bin folders are checked in the default tier)
    [
        pytest.param([], marks=pytest.mark.slow),
        pytest.param(["--in-memory"], marks=pytest.mark.slow),
    ],
    ids=["streamed", "in-memory"],
)
def test_merge_of_bin_folders_equals_merge_of_safetensors(peft_folders, tmp_path, capsys, mode):
    outs = {}
    for fmt in ("safetensors", "bin"):
        outs[fmt] = tmp_path / fmt
        folders = [str(peft_folders[fmt, "float32", t]) for t in range(2)]
        rc, _, err = _run(capsys, "merge", *folders, "--budget", "3", "--out", str(outs[fmt]),
                          "--no-plots", "--quiet", *mode)  # fmt: skip
        assert rc == 0, err
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (outs["bin"] / name).read_bytes() == (outs["safetensors"] / name).read_bytes()
    reports = []
    for fmt, out in outs.items():
        # the same report but for the folders' names (as tasks and paths) and the time
        text = (out / "netutility_report.json").read_text().replace(f"{fmt}-float32", "T-float32")
        r = json.loads(text)
        r.pop("adapters"), r.pop("created_utc")
        for item in r["config"]["adapters"]:  # (each folder's own files' digest: they differ)
            assert len(item.pop("sha256")) == 64
        reports.append(r)
    assert reports[0]["tasks"][0]["name"] == "T-float32-0"
    assert reports[0] == reports[1]


def test_inspect_of_bin_folders_equals_inspect_of_safetensors(peft_folders, capsys):
    infos = {}
    for fmt in ("safetensors", "bin"):
        folders = [str(peft_folders[fmt, "bfloat16", t]) for t in range(2)]
        rc, out, err = _run(capsys, "inspect", *folders, "--json")
        assert rc == 0, err
        infos[fmt] = json.loads(out)
        for t in infos[fmt]["tasks"]:
            t.pop("adapter")
    assert infos["bin"] == infos["safetensors"]


# ---------------------------------------------------------------------------------------------
# netutility convert
# ---------------------------------------------------------------------------------------------


def _digest(folder: pathlib.Path) -> dict[str, tuple[str, int]]:
    """Every file under ``folder``: its hash and mtime (to show it was not touched)."""
    return {
        str(p.relative_to(folder)): (
            hashlib.sha256(p.read_bytes()).hexdigest(),
            p.stat().st_mtime_ns,
        )
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _no_staging(folder: pathlib.Path) -> None:
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]


@HF_WARNINGS
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_convert_round_trip(peft_folders, tmp_path, capsys, dtype):
    src, st = peft_folders["bin", dtype, 1], peft_folders["safetensors", dtype, 1]
    before = _digest(src)
    out = tmp_path / "converted"
    rc, stdout, err = _run(capsys, "convert", str(src), str(out))
    assert rc == 0, err
    assert stdout.startswith(f"converted {src} (adapter_model.bin: 8 tensors, {dtype}")
    assert _digest(src) == before  # SRC is only read
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert (out / "adapter_config.json").read_bytes() == (src / "adapter_config.json").read_bytes()
    # the same tensors as the bin (names, dtypes, bits), and as PEFT's own safetensors save
    got = safetensors_numpy.load_file(str(out / "adapter_model.safetensors"))
    want = _read(src / "adapter_model.bin")
    peft_st = safetensors_numpy.load_file(str(st / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want) == sorted(peft_st)
    for k in want:
        assert got[k].dtype == want[k].dtype == peft_st[k].dtype, k
        assert got[k].tobytes() == want[k].tobytes() == peft_st[k].tobytes(), k
    _assert_adapters_equal(nu_peft.load_adapter(out), nu_peft.load_adapter(src))
    # and PEFT loads it: the same LoRA weights as PEFT loading the bin
    peft = pytest.importorskip("peft")
    base = _tiny_llama()
    a = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(out)).state_dict()
    b = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(src)).state_dict()
    lora = [k for k in a if "lora_" in k]
    assert len(lora) == 8 and all(torch.equal(a[k], b[k]) for k in lora)
    _no_staging(tmp_path)


def test_convert_output_rules(peft_folders, tmp_path, capsys):
    src = peft_folders["bin", "float32", 0]
    before = _digest(src)
    # an empty folder is fine
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = _run(capsys, "convert", str(src), str(empty))
    assert rc == 0, err
    assert (empty / "adapter_model.safetensors").is_file()
    # an existing non-empty folder: refused without --overwrite, replaced with it
    rc, _, err = _run(capsys, "convert", str(src), str(empty))
    assert rc == 2 and err.count("\n") == 1
    assert "already exists and is not empty" in err and "--overwrite" in err
    (empty / "stale.txt").write_text("from an earlier run")
    rc, out, err = _run(capsys, "convert", str(src), str(empty), "--overwrite")
    assert rc == 0, err
    assert "replaced the folder" in out
    assert sorted(p.name for p in empty.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    # --overwrite never replaces a folder that holds no adapter
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    rc, _, err = _run(capsys, "convert", str(src), str(mine), "--overwrite")
    assert rc == 2 and "replaces only an adapter folder" in err and "notes.txt" in err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    # SRC itself, a folder inside it, a folder that holds it: refused, even with --overwrite
    for out_dir, where in (
        (src, "is SRC_FOLDER"),
        (src / "sub", "is inside SRC_FOLDER"),
        (src.parent, "holds SRC_FOLDER"),
    ):
        rc, _, err = _run(capsys, "convert", str(src), str(out_dir), "--overwrite")
        assert rc == 2 and where in err and err.count("\n") == 1, err
    assert not (src / "sub").exists()
    # a file where the folder should be
    (tmp_path / "file").write_text("x")
    rc, _, err = _run(capsys, "convert", str(src), str(tmp_path / "file"))
    assert rc == 2 and "is a file" in err
    assert _digest(src) == before
    _no_staging(tmp_path)


def test_convert_never_leaves_a_half_written_output(peft_folders, tmp_path, capsys, monkeypatch):
    src = peft_folders["bin", "float32", 0]
    earlier = tmp_path / "earlier"
    rc, _, err = _run(capsys, "convert", str(src), str(earlier))
    assert rc == 0, err
    was = _digest(earlier)

    def half_then_fail(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError(28, "No space left on device", filename)

    monkeypatch.setattr(safetensors_numpy, "save_file", half_then_fail)
    for out, flags in ((tmp_path / "new", []), (earlier, ["--overwrite"])):
        rc, _, err = _run(capsys, "convert", str(src), str(out), *flags)
        assert rc == 2 and err.count("\n") == 1, err
        assert "No space left on device" in err and "nothing was written" in err
    assert not (tmp_path / "new").exists()
    assert _digest(earlier) == was  # the folder --overwrite would replace is as it was
    _no_staging(tmp_path)


# ---------------------------------------------------------------------------------------------
# Hostile and broken files: InputError naming the file, nothing run
# ---------------------------------------------------------------------------------------------


def _s(text: str) -> bytes:  # BINUNICODE
    b = text.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _i(n: int) -> bytes:  # BININT
    return b"J" + struct.pack("<i", n)


def _g(module: str, name: str) -> bytes:  # GLOBAL
    return b"c" + f"{module}\n{name}\n".encode()


def _t(*items: bytes) -> bytes:  # MARK ... TUPLE
    return b"(" + b"".join(items) + b"t"


def _tensor(
    key="0", numel=6, offset=0, size=(2, 3), stride=(3, 1), storage=("torch", "FloatStorage"),
    hooks=b"}", rebuild=("torch._utils", "_rebuild_tensor_v2"),
) -> bytes:  # fmt: skip
    """The opcodes torch.save writes for one tensor (``hooks``: the backward-hooks argument)."""
    pid = _t(_s("storage"), _g(*storage), _s(key), _s("cpu"), _i(numel)) + b"Q"  # BINPERSID
    args = _t(pid, _i(offset), _t(*map(_i, size)), _t(*map(_i, stride)), b"\x89", hooks)
    return _g(*rebuild) + args + b"R"  # REDUCE


def _state(**tensors: bytes) -> bytes:
    """A pickled dict ``{name: tensor}`` (protocol 2, as torch.save writes)."""
    return b"\x80\x02}" + b"".join(_s(k) + v + b"s" for k, v in tensors.items()) + b"."


def _archive(path: pathlib.Path, pkl: bytes, records=None, *, top="archive") -> pathlib.Path:
    """A zip laid out as torch.save lays it out: data.pkl, byteorder, data/<key>, version."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{top}/data.pkl", pkl)
        z.writestr(f"{top}/byteorder", b"little")
        for key, data in (records or {}).items():
            z.writestr(f"{top}/data/{key}", data)
        z.writestr(f"{top}/version", b"3\n")
    return path


SIX = {"0": np.arange(6, dtype="<f4").tobytes()}


def test_handmade_archive_reads(tmp_path):
    """The opcodes the hostile cases below bend are the ones torch writes: unbent, they read."""
    f = _archive(
        tmp_path / "ok.bin", _state(w=_tensor(), t=_tensor(size=(3, 2), stride=(1, 3))), SIX
    )
    got = _read(f)
    assert got["w"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert got["t"].tolist() == [[0, 3], [1, 4], [2, 5]]


class _Reduce:
    """Pickles as a call of ``fn(*args)`` (what a hostile checkpoint holds)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _payloads(marker: pathlib.Path) -> dict[str, tuple[object, str]]:
    """``{case: (object whose unpickling would create marker, a regex of the global refused)}``
    (protocol 2 writes Python 2's names: ``__builtin__.eval``, ``commands.call``)."""
    touch = f"open({str(marker)!r}, 'w').close()"
    return {
        "os.system": (_Reduce(os.system, f"touch {marker}"), rf"{os.system.__module__}\.system"),
        "builtins.eval": (
            _Reduce(eval, touch),
            r"(builtins\.eval|__builtin__\.eval' "
            r"\(Python 3's builtins\.eval\))",
        ),
        "builtins.exec": (
            _Reduce(exec, touch),
            r"(builtins\.exec|__builtin__\.exec' "
            r"\(Python 3's builtins\.exec\))",
        ),
        "subprocess.call": (
            _Reduce(subprocess.call, ["touch", str(marker)]),
            r"(subprocess\.call|commands\.call' \(Python 3's subprocess\.call\))",
        ),
    }


@pytest.mark.parametrize("case", ["os.system", "builtins.eval", "builtins.exec", "subprocess.call"])
def test_the_payloads_do_run_when_unpickled_plainly(tmp_path, case):
    """The control of the test below: plain pickle.loads runs each payload (it creates marker)."""
    marker = tmp_path / "ran"
    payload, _ = _payloads(marker)[case]
    pickle.loads(pickle.dumps(payload, protocol=2))
    assert marker.exists()


@pytest.mark.parametrize("protocol", [2, 4, 5])
@pytest.mark.parametrize("case", ["os.system", "builtins.eval", "builtins.exec", "subprocess.call"])
def test_hostile_reduce_is_refused_and_nothing_runs(tmp_path, capsys, case, protocol):
    marker = tmp_path / "ran"
    payload, refused = _payloads(marker)[case]
    # alone, and hidden as a value of an otherwise plain state dict
    for i, obj in enumerate((payload, {"base_model.model.q.lora_A.weight": payload})):
        f = _archive(tmp_path / f"evil{i}.bin", pickle.dumps(obj, protocol=protocol))
        with pytest.raises(InputError) as e:
            _read(f)
        assert str(f) in str(e.value) and re.search(f"the global '{refused}", str(e.value))
        assert "refused before anything was built" in str(e.value)
        assert not marker.exists()
    # through the loader and the command, as an adapter folder's adapter_model.bin
    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (tmp_path / "evil1.bin").rename(d / "adapter_model.bin")
    with pytest.raises(InputError, match=rf"{re.escape(str(d / 'adapter_model.bin'))}.*{refused}"):
        nu_peft.load_adapter(d)
    for argv in (["inspect", str(d)], ["merge", str(d), "--budget", "2", "--out", str(tmp_path / "m")],
                 ["convert", str(d), str(tmp_path / "c")]):  # fmt: skip
        rc, _, err = _run(capsys, *argv)
        assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert re.search(f"{re.escape(str(d))}.*the global '{refused}", err), err
    assert not (tmp_path / "m").exists() and not (tmp_path / "c").exists()
    assert not marker.exists()


def test_hostile_global_after_valid_tensors_runs_nothing(tmp_path):
    """A refused global anywhere (here the backward hooks of a second tensor, after a valid one)
    stops the read when it is named: it is never called."""
    marker = tmp_path / "ran"
    hooks = _g("posix", "system") + _t(_s(f"touch {marker}")) + b"R"
    f = _archive(tmp_path / "x.bin", _state(ok=_tensor(), bad=_tensor(hooks=hooks)), SIX)
    with pytest.raises(InputError, match=r"names the global 'posix\.system'"):
        _read(f)
    assert not marker.exists()


@pytest.mark.parametrize(
    "pkl, match",
    [
        (_state(w=_tensor(rebuild=("torch._utils", "_rebuild_tensor_v2.__globals__"))),
         r"names the global 'torch\._utils\._rebuild_tensor_v2\.__globals__'"),
        (_state(w=_tensor(rebuild=("torch", "load"))), r"names the global 'torch\.load'"),
        (_state(w=_tensor(storage=("torch", "Storage"))), r"names the global 'torch\.Storage'"),
        (_state(w=_tensor(storage=("numpy", "ndarray"))), r"names the global 'numpy\.ndarray'"),
        (_state(w=_tensor(key="7")),
         r"refers to the storage '7', which the archive does not hold \(no 'archive/data/7'\)"),
        (_state(w=_tensor(numel=9, size=(3, 3))),
         r"storage '0' is 9 float32 elements \(36 bytes\), but its record holds 24 bytes"),
        (_state(w=_tensor(numel=6, size=(3, 3))),
         r"a float32 tensor of shape \(3, 3\) \(strides \(3, 1\), offset 0\) needs 9 elements of "
         r"storage '0', which holds 6"),
        (_state(w=_tensor(offset=4, size=(3,), stride=(1,))), r"needs 7 elements of storage '0'"),
        (_state(w=_tensor(size=(2, 3), stride=(0, 1), numel=3)), r"broadcast or overlapping view"),
        (_state(w=_tensor(stride=(3, -1))), r"negative values are not a torch tensor"),
        (_state(w=_tensor(size=(1,) * 40, stride=(1,) * 40)), r"at most 32 axes"),
        (_state(w=_i(3)), r"holds 'w': a int, not a tensor"),
        (b"\x80\x02]" + _tensor() + b"a.", r"holds a pickled list, not a state dict"),
        (b"\x80\x02}" + _i(1) + _tensor() + b"s.", r"has the key 1; tensor names are strings"),
        (b"\x80\x02}" + _s("w") + _t(_s("module"), _s("x")) + b"Qs.",
         r"refers to the persistent object \('module', 'x'\)"),
        (b"\x80\x02}" + _s("w") + b"\x82\x01s.", r"pickle opcode EXT1 \(code 1\)"),
        (b"\x80\x02}" + _s("w") + _tensor() + b"}" + _s("info") + _s("x") + b"sbs.",
         r"not a pickled state dict of tensors"),  # BUILD on a tensor
        (_state(w=_tensor())[:-5], r"is not a valid pickle"),  # cut short
    ],
    ids=[
        "dotted-name", "torch.load", "storage-base-class", "numpy-global", "missing-storage",
        "short-record", "view-past-storage", "offset-past-storage", "broadcast", "negative-stride",
        "too-many-axes", "not-a-tensor", "not-a-dict", "non-string-key", "other-persistent-id",
        "extension-opcode", "build-on-tensor", "truncated-pickle",
    ],
)  # fmt: skip
def test_broken_or_hostile_pickles_are_refused(tmp_path, pkl, match):
    f = _archive(tmp_path / "adapter_model.bin", pkl, SIX)
    with pytest.raises(InputError, match=match) as e:
        _read(f)
    assert str(e.value).startswith(f"{FN}: {str(f)!r}: ")


def test_broken_archives_are_refused(tmp_path):
    good = tmp_path / "good.bin"
    torch.save({"w": torch.ones(64, 64)}, good)
    data = good.read_bytes()
    cases = {
        "truncated.bin": (data[: len(data) // 2], r"is a corrupt or truncated zip archive"),
        "random.bin": (bytes(range(256)) * 4, r"is not a file torch\.save writes"),
        "empty.bin": (b"", r"is not a file torch\.save writes"),
        "text.bin": (b"not really a pickle", r"is not a file torch\.save writes"),
    }
    for name, (content, match) in cases.items():
        f = tmp_path / name
        f.write_bytes(content)
        with pytest.raises(InputError, match=match) as e:
            _read(f)
        assert str(f) in str(e.value), name
    # a zip without data.pkl, or with two, or with an unknown byte order
    nopkl = tmp_path / "nopkl.bin"
    _rewrite_zip(good, nopkl, lambda n, d: None if n.endswith("data.pkl") else (n, d))
    with pytest.raises(
        InputError, match=r"nopkl\.bin': is a zip archive without <folder>/data\.pkl"
    ):
        _read(nopkl)
    two = tmp_path / "two.bin"
    with zipfile.ZipFile(two, "w") as z:
        z.writestr("a/data.pkl", _state())
        z.writestr("b/data.pkl", _state())
    with pytest.raises(InputError, match=r"two\.bin': holds 2 pickles"):
        _read(two)
    order = tmp_path / "order.bin"
    _rewrite_zip(good, order, lambda n, d: (n, b"middle") if n.endswith("byteorder") else (n, d))
    with pytest.raises(InputError, match=r"order\.bin': its byteorder record says b'middle'"):
        _read(order)
    # a storage record shorter than the pickle says: refused when the pickle names it
    short = tmp_path / "short.bin"
    _rewrite_zip(good, short, lambda n, d: (n, d[:100]) if "/data/" in n else (n, d))
    with pytest.raises(InputError, match=r"storage '0' is 4096 float32 elements \(16384 bytes\), "
                       r"but its record holds 100 bytes"):  # fmt: skip
        _read(short)


def test_legacy_format_is_refused_with_how_to_resave(tmp_path, capsys):
    f = tmp_path / "legacy.bin"
    torch.save({"w": torch.ones(2)}, f, _use_new_zipfile_serialization=False)
    with pytest.raises(
        InputError, match=r"legacy pickle format.*only torch's default zip format is.*Re-save it"
    ):
        _read(f)
    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    f.rename(d / "adapter_model.bin")
    with pytest.raises(
        InputError,
        match=rf"{re.escape(str(d / 'adapter_model.bin'))}' is in torch's legacy pickle format.*"
        r"holds only the "
        r"pickled adapter_model\.bin.*safe_serialization=True",
    ):
        nu_peft.load_adapter(d)
    rc, _, err = _run(capsys, "convert", str(d), str(tmp_path / "out"))
    assert rc == 2 and "legacy pickle format" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_bin_that_is_a_folder_is_refused(tmp_path):
    d = tmp_path / "adapter"
    (d / "adapter_model.bin").mkdir(parents=True)
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    with pytest.raises(
        FileNotFoundError, match=r"adapter_model\.bin' is a folder, expected the torch file"
    ):
        nu_peft.load_adapter(d)


def test_safetensors_wins_over_a_bin_in_the_same_folder(peft_folders, tmp_path):
    """PEFT reads adapter_model.safetensors when both are there; so does the loader (the bin,
    here hostile, is not even opened)."""
    d = tmp_path / "both"
    d.mkdir()
    src = peft_folders["safetensors", "float32", 0]
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (d / name).write_bytes((src / name).read_bytes())
    (d / "adapter_model.bin").write_bytes(pickle.dumps(_Reduce(os.system, "false")))
    _assert_adapters_equal(nu_peft.load_adapter(d), nu_peft.load_adapter(src))
