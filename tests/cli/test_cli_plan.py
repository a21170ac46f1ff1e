"""``netutility merge --dry-run`` (the plan), the warning about tasks below half their uniform
share, ``--min-share``, and the tasks' names on the terminal, in the report and in the plots."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax import cli

pytest.importorskip("safetensors")

NAMES = [f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ("q_proj", "v_proj")]
D_IN, D_OUT = 24, 16
BASE = {"base_model_name_or_path": "tiny-test-model", "task_type": "CAUSAL_LM"}


def _adapter(seed: int, r: int, scale: float = 2.0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        n: {
            "lora_a": rng.normal(size=(D_IN, r)).astype(np.float32),
            "lora_b": (rng.normal(size=(r, D_OUT)) / 4).astype(np.float32),
            "scale": scale,
        }
        for n in NAMES
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> list[str]:
    """Three tasks whose folders are all named 'adapter' (told apart by their parents), the
    first one's update 40x larger: it interferes most and starves under net_utility."""
    root = tmp_path_factory.mktemp("plan")
    out = []
    for i, (name, r, scale) in enumerate((("sql", 4, 80.0), ("chat", 3, 2.0), ("code", 4, 2.0))):
        p = root / name / "adapter"
        nu.peft.save_adapter(_adapter(i, r, scale), p, base_config=BASE)
        out.append(str(p))
    return out


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


TASKS = ["sql/adapter", "chat/adapter", "code/adapter"]


def test_dry_run_prints_the_merge_s_plan_and_writes_nothing(folders, tmp_path, capsys):
    """The plan's kept directions and ranks are those of the merge that follows (its report),
    its output size is the size of the tensors that merge writes, and OUT_DIR is never
    created by the dry run."""
    out = tmp_path / "o"
    rc, stdout, err = _run(capsys, "merge", *folders, "--budget", "3", "--dry-run",
                           "--out", str(out))  # fmt: skip
    assert rc == 0, err
    assert not out.exists() and not list(tmp_path.iterdir())
    assert "estimate: about" in stdout and "dry run: nothing merged or written" in stdout
    rc, _, err = _run(capsys, "merge", *folders, "--budget", "3", "--out", str(out),
                      "--quiet", "--no-plots")  # fmt: skip
    assert rc == 0, err
    rep = json.loads((out / cli.REPORT_NAME).read_text())
    for name, kept in zip(TASKS, rep["kept_per_task"], strict=True):
        row = next(line for line in stdout.splitlines() if line.strip().startswith(name))
        assert int(row.split()[1]) == kept
        assert " 4.0 " in row  # uniform share: 3 x 4 modules / 3 tasks
    for n in NAMES:
        row = next(line for line in stdout.splitlines() if line.strip().startswith(n))
        assert int(row.split()[1]) == rep["ranks"][n]  # TA: the rank is what the module keeps
    # the size it announces is that of the tensors the merge wrote
    p = nu.planning.plan(nu.peft.open_adapters(folders), budget=3, alpha="auto")
    assert f"about {nu._core.checks.size_text(p.out_bytes)} of adapter tensors" in stdout
    st = pytest.importorskip("safetensors.numpy").load_file(str(out / "adapter_model.safetensors"))
    assert p.out_bytes == sum(t.nbytes for t in st.values())


def test_dry_run_needs_no_out_and_flags_low_shares(folders, capsys):
    rc, stdout, err = _run(capsys, "merge", *folders, "--budget", "3", "--dry-run")
    assert rc == 0, err
    assert "<- below 0.5 of its share" in next(
        line for line in stdout.splitlines() if line.strip().startswith("sql/adapter")
    )
    assert err.startswith("netutility merge: warning: sql/adapter would keep ")
    assert "--min-share 0.5" in err


def test_low_share_warning_and_min_share(folders, tmp_path, capsys):
    """A task below half its uniform share is warned about, one line naming it (the tasks below
    it read from the report's own numbers); --min-share 0.5 with --keep-nonpositive lifts it to
    int(0.5 x share) and the warning goes."""
    out = tmp_path / "o"
    rc, stdout, err = _run(capsys, "merge", *folders, "--budget", "3", "--out", str(out),
                           "--quiet", "--no-plots", "--keep-nonpositive")  # fmt: skip
    assert rc == 0, err
    rep = json.loads((out / cli.REPORT_NAME).read_text())
    low = [t["name"] for t in rep["tasks"] if t["kept"] < 0.5 * t["uniform_share"]]
    assert low == ["sql/adapter"]
    warnings = [line for line in err.splitlines() if "uniform share" in line]
    assert len(warnings) == 1 and warnings[0].startswith("netutility merge: warning: sql/adapter ")
    assert "kept per task [sql/adapter 0, chat/adapter " in stdout
    rc, stdout, err = _run(capsys, "merge", *folders, "--budget", "3", "--out", str(tmp_path / "f"),
                           "--quiet", "--no-plots", "--keep-nonpositive", "--min-share", "0.5")  # fmt: skip
    assert rc == 0, err
    rep = json.loads((tmp_path / "f" / cli.REPORT_NAME).read_text())
    assert rep["tasks"][0]["kept"] == int(0.5 * rep["tasks"][0]["uniform_share"]) == 2
    assert rep["min_share"] == 0.5 and rep["config"]["min-share"] == 0.5
    assert "uniform share" not in err


def test_min_share_needs_net_utility(folders, tmp_path, capsys):
    rc, _, err = _run(capsys, "merge", *folders, "--budget", "3", "--allocation", "uniform",
                      "--min-share", "0.5", "--out", str(tmp_path / "o"))  # fmt: skip
    assert (
        rc == 2
        and err.count("\n") == 1
        and "--min-share applies to --allocation net_utility" in err
    )
    with pytest.raises(SystemExit):
        cli.main(["merge", *folders, "--budget", "3", "--min-share", "2", "--dry-run"])
    assert "argument --min-share" in capsys.readouterr().err


def test_plots_name_the_tasks(folders, tmp_path, capsys, monkeypatch):
    """The plots get the tasks' names (the plotting itself is tests/io/test_plots.py's)."""
    seen = {}

    def record(fn):
        def plot(*args, path, **kw):
            seen[fn] = args[-1] if fn in ("kept_per_task", "utility_distribution") else None
            pathlib.Path(path).write_bytes(b"")

        return plot

    for fn in ("budget_heatmap", "kept_per_task", "prefix_retention", "utility_distribution"):
        monkeypatch.setattr(nu.plots, fn, record(fn))
    rc, _, err = _run(capsys, "merge", *folders, "--budget", "3", "--out", str(tmp_path / "o"),
                      "--quiet")  # fmt: skip
    assert rc == 0, err
    assert seen["kept_per_task"] == TASKS and seen["utility_distribution"] == TASKS
