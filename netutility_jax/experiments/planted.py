"""``python -m netutility_jax.experiments.planted``: the planted-interference study (issue 44,
pre-registered in docs/experiments.md; :mod:`netutility_jax.experiments.harness.planted`).

Each seed is run, saved (``seed<N>.json``, ``seed<N>.npz``) and the report (``results.json``,
``results.md``) re-rendered from every seed in ``--out``: a seed run later, or by another
process, joins the same report. A seed already in ``--out`` is not run again unless
``--merges`` asks for more than it has (``none`` < ``primary`` < ``all``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shlex
import sys
from collections.abc import Sequence

from ..errors import NetUtilityError
from .demo import DemoError, check_cache_dir, check_data, check_weights, load_tasks, task_args
from .harness import planted as pl

PROG = "python -m netutility_jax.experiments.planted"
_ORDER = {"none": 0, "primary": 1, "all": 2}


def _seeds(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not out or any(s < 0 for s in out):
        raise argparse.ArgumentTypeError(f"expected non-negative seeds, got {text!r}")
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=_seeds, default=(0, 1, 2, 3, 4), metavar="0,1,2,3,4")
    p.add_argument("--out", required=True, metavar="DIR", help="where the seeds and the report go")
    p.add_argument("--cache-dir", default=None, metavar="DIR", help="trained adapters and merges")
    p.add_argument(
        "--merges",
        choices=tuple(_ORDER),
        default="primary",
        help="which merges are evaluated for accuracy: primary (the pre-registered comparisons' "
        "merges, gamma 1, R 16 and full capacity), all (every arm, allocation and budget), none "
        "(read-out (a) only: exact, no evaluation)",
    )
    p.add_argument("--quick", action="store_true", help="the quick preset's 3 tasks (a smoke test)")
    p.add_argument("--render", action="store_true", help="only re-render the report of --out")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    command = shlex.join(["python", "-m", "netutility_jax.experiments.planted", *argv])
    try:
        return run(args, command)
    except NetUtilityError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.code if isinstance(e, DemoError) else 2


def run(args: argparse.Namespace, command: str) -> int:
    """Run (or ``args.render``: only re-render) the study for the parsed options; ``command``
    is recorded in every seed and the report."""
    from .suites import encoder as enc

    out = pathlib.Path(args.out)
    if out.exists() and not out.is_dir():
        raise DemoError(f"--out {out} is a file; give a directory")
    if not args.render:
        preset = enc.QUICK if args.quick else enc.FULL
        # the per-task initialisation (the default preset's; the regime study's per-task cell)
        preset = dataclasses.replace(
            preset, train=dataclasses.replace(preset.train, init="per_task")
        )
        pairs = (("word_sentiment", "word_pos"),) if args.quick else pl.PAIRS
        cache = check_cache_dir(args.cache_dir)
        specs = task_args([], None, preset.tasks)
        check_data(specs)
        check_weights("encoder")
        task_list = load_tasks(specs, preset)
        suite = enc.EncoderSuite()
        for seed in args.seeds:
            done = out / f"seed{seed}.json"
            if done.exists():
                had = json.loads(done.read_text()).get("merges", "none")
                if _ORDER[had] >= _ORDER[args.merges]:
                    print(
                        f"{PROG}: seed {seed} is in {out} (merges {had}); not run again", flush=True
                    )
                    continue
            rec = pl.run_seed(
                seed, task_list, preset, suite, cache_dir=cache, merges=args.merges,
                log=lambda s: print(s, flush=True), pairs=pairs,
            )  # fmt: skip
            pl.save_seed(out, rec, command=command)
            _render(out, command)
    else:
        _render(out, command)
    return 0


def _render(out: pathlib.Path, command: str) -> None:
    seeds = pl.load_seeds(out)
    results, markdown = pl.render(seeds, command=command)
    written = pl.write(out, results, markdown)
    print(f"{PROG}: {len(seeds)} seed(s) rendered: {', '.join(written)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
