"""Sharding buckets over a device mesh (``mesh=``, :mod:`netutility_jax._core.mesh`).

The 8-device checks run in a child process (``tests/operators/_mesh_child.py``) with
``--xla_force_host_platform_device_count=8``, which must be set before JAX starts: scores, masks,
ranks and merged updates with ``mesh=`` against the same calls on one device. In this process
(one CPU device) a one-device mesh runs the mesh code path (factors stacked on the host) and must
give the plain path's results bit for bit.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import netutility_jax as nu
from netutility_jax._core import mesh as _mesh
from netutility_jax.errors import InputError, InputTypeError

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import _mesh_child

CHILD = pathlib.Path(__file__).parent / "_mesh_child.py"


def _run_child(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NETUTILITY_MESH_SPMD"}
    # the session's compile flags (tests/conftest.py) stay; the device count is this test's
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags.append("--xla_force_host_platform_device_count=8")
    env.update(XLA_FLAGS=" ".join(flags), NETUTILITY_COMPILE_CACHE="off")
    proc = subprocess.run(
        [sys.executable, str(CHILD), *args], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_child(found: dict, cases: list) -> None:
    assert found["devices"] == 8
    # each of the 8 devices holds its own 2 of the 16 (11 padded) modules, not a copy of all
    assert found["n_shards"] == 8 and found["shards"] == [[2, 3, 64, 4]]
    for mode in ("in_turn", "spmd"):
        got = found[mode]
        for d in (8, 3) if len(cases) > 1 else (8,):
            s = got[f"score_{d}"]
            assert s["masks_equal"], (mode, d)
            assert s["lam"] <= 1e-6 and s["fields"] <= 1e-6, (mode, s)  # float32 rounding
        assert sorted(got["cases"]) == sorted(f"{m}/{sp}" for m, sp, _ in cases)
        for name, c in got["cases"].items():
            assert c["masks_equal"] and c["ranks_equal"], (mode, name)
            if name.split("/")[1] == "full" and name.split("/")[0] in ("ties", "dare", "dare_ties"):
                # elementwise in full space: module by module on one device as on the mesh
                assert c["exact"], (mode, name, c["rel"])  # the same masks: the same bits
            else:
                # one device runs every bucket as one program (engine/ta.py for TA,
                # engine/program.py for the others), a mesh the bucket pipeline stage by
                # stage: the same merge to float32 rounding
                assert c["rel"] <= 2e-5, (mode, name, c["rel"])
        if len(cases) > 1:  # netutility merge --devices all (8) vs --devices 1, streamed
            cli = got["cli"]
            assert cli["same_names"] and cli["rel"] <= 2e-5, (mode, cli)


# every method, the CLI and a 3-device mesh (it was run after a TA-only child, a subset of it)
@pytest.mark.slow
def test_eight_devices_match_one_device_every_method():
    _check_child(_run_child("all"), _mesh_child.ALL_CASES)


def _assert_same(a, b):
    assert list(a) == list(b)
    for n in a:
        for x, y in zip(jax.tree.leaves(a[n]), jax.tree.leaves(b[n]), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    ("method", "space", "opts"),
    [  # 9-17 s each: in the slow tier, which CI runs
        pytest.param("tsv", "core", {}, marks=pytest.mark.slow),
        pytest.param("ties", "knots", {}, marks=pytest.mark.slow),
    ],
)
def test_one_device_mesh_is_the_plain_path(method, space, opts):
    ads = _mesh_child.adapters()
    mesh = nu.module_mesh()
    assert mesh.axis_names == ("modules",) and mesh.size == jax.local_device_count()
    sc, sc_m = nu.score(ads), nu.score(ads, mesh=mesh)
    for n in sc.modules:
        _assert_same({n: tuple(sc.modules[n])}, {n: tuple(sc_m.modules[n])})
    np.testing.assert_array_equal(np.asarray(sc.lam), np.asarray(sc_m.lam))
    out, rep = nu.merge_adapters(ads, budget=3, method=method, space=space, **opts)
    out_m, rep_m = nu.merge_adapters(ads, budget=3, method=method, space=space, mesh=mesh, **opts)
    assert rep.ranks == rep_m.ranks
    # without a mesh every bucket runs as one program (engine/program.py), with one the stages
    # one by one: the same arithmetic, XLA fusing across the former boundaries (float32 rounding)
    for n in out:
        want = np.asarray(nu.module_update(out[n]))
        np.testing.assert_allclose(
            np.asarray(nu.module_update(out_m[n])), want, rtol=0, atol=2e-5 * np.abs(want).max()
        )


def test_host_stack_pads_modules_and_ranks():
    ads = _mesh_child.adapters()
    bk = nu._core.tree.collect(ads, fn="t")[1][1]  # the v bucket: task 2 lacks l5.v
    st = _mesh.host_stack(bk, np.float32, 12)
    assert st.a.shape == (12, 3, 64, 6) and st.b.shape == (12, 3, 6, 48)
    j = bk.names.index("l5.v")
    np.testing.assert_array_equal(st.rank[j], [6, 6, 0])
    assert not st.a[j, 2].any() and not st.b[j, 2].any() and st.scale[j, 2] == 0
    assert not st.a[11:].any() and not st.rank[11:].any()  # the padding module
    # task 2's rank-3 factors, zero-padded to r_max = 6
    np.testing.assert_array_equal(st.a[0, 2, :, :3], ads[2][bk.names[0]]["lora_a"])
    assert not st.a[0, 2, :, 3:].any()


def test_bad_mesh_is_refused_with_a_clear_error():
    ads = _mesh_child.adapters()
    with pytest.raises(InputTypeError, match=r"mesh is a list; expected None or a jax\.sharding"):
        nu.score(ads, mesh=jax.devices())
    two_axes = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("a", "b"))
    with pytest.raises(InputError, match=r"mesh has axes \('a', 'b'\).*expected one axis"):
        nu.merge(ads, method="ta", mesh=two_axes)
    with pytest.raises(InputError, match="mesh= stacks the factors on the host"):
        jax.jit(lambda a: nu.score(a, lam=0.5, mesh=nu.module_mesh()).lam)(ads)
    with pytest.raises(InputError, match="no devices given"):
        nu.module_mesh([])


def test_cli_devices_beyond_this_process_is_a_usage_error(tmp_path, capsys):
    from netutility_jax import cli

    folders = []
    for i, ad in enumerate(_mesh_child.adapters()[:2]):
        folders.append(str(tmp_path / f"t{i}"))
        nu.peft.save_adapter(ad, folders[-1])
    n = jax.local_device_count() + 1
    rc = cli.main(
        ["merge", *folders, "--budget", "2", "--devices", str(n), "--out", str(tmp_path / "o")]
    )
    err = capsys.readouterr().err
    assert rc == 2 and f"--devices {n}: this process has {n - 1} device(s)" in err
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit):
        cli.main(["merge", *folders, "--budget", "2", "--devices", "0", "--out", "o"])
    assert "is not 'all' or a positive number of devices" in capsys.readouterr().err
