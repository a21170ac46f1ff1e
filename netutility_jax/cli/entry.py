"""``main``, the entry point of the ``netutility`` console script: parse, pick the subcommand,
turn on the persistent compilation cache, and map what it raises to an exit code and one line
on stderr."""

from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import sys
import traceback
from collections.abc import Callable, Sequence

from .._core import exports as _exports
from ..errors import NetUtilityError, PeerLostError, one_line
from .common import PROG, say
from .convert import cmd_convert
from .demo import cmd_demo
from .inspect import cmd_inspect
from .merge import cmd_merge
from .parser import MAX_MESSAGE, build_parser, required_merge_arguments

__all__ = [
    "CPU_COMPILE_FLAGS",
    "EXPORTS",
    "cpu_compile_flags",
    "default_compile_cache",
    "enable_compile_cache",
    "exit_now",
    "main",
    "run",
]


#: The subfolder of the compilation cache where traced programs are kept (see
#: :func:`enable_compile_cache`).
EXPORTS = "netutility-exports"


def default_compile_cache() -> pathlib.Path | None:
    """The persistent compilation cache folder: ``$NETUTILITY_COMPILE_CACHE`` (``off``: none),
    else ``$XDG_CACHE_HOME/netutility-jax/jax`` (``~/.cache/netutility-jax/jax``)."""
    env = os.environ.get("NETUTILITY_COMPILE_CACHE")
    if env in ("off", "0"):
        return None
    if env:
        return pathlib.Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "netutility-jax" / "jax"


def enable_compile_cache(folder: pathlib.Path) -> bool:
    """Turn on JAX's persistent compilation cache in ``folder`` (every kernel the command
    compiles), and keep the traced programs of the kernels that export them in its
    :data:`EXPORTS` subfolder (:mod:`netutility_jax._core.exports`: no compiled code). A folder that
    cannot be created is a note, not an error: the command runs without the cache. Returns
    whether the cache is on."""
    import jax

    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(f"{folder} is not writable")
    except OSError as e:
        say("cache", "note", f"compilation cache off ({e}); use --no-compile-cache to silence")
        return False
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _exports.set_folder(folder / EXPORTS)
    return True


# XLA:CPU code generation for the command's programs, unless XLA_FLAGS names the flag: its
# legacy emitters compile the library's small programs in about half the time of its MLIR
# fusion emitters (benchmarks/cli_merge.py; no flag changes what a program computes, and a GPU
# or TPU backend ignores them).
CPU_COMPILE_FLAGS = ("xla_cpu_use_fusion_emitters=false",)


def cpu_compile_flags() -> None:
    """Add :data:`CPU_COMPILE_FLAGS` to ``XLA_FLAGS`` (those it does not name already), before
    the command's first computation starts the backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in CPU_COMPILE_FLAGS:
        if flag.split("=")[0] not in flags:
            flags = f"{flags} --{flag}".strip()
    os.environ["XLA_FLAGS"] = flags


def exit_now(code: int) -> None:
    """End this ``netutility`` process with ``code``, its work done and written, without
    Python's teardown: JAX's exit handlers clear its backends and caches and the interpreter
    then collects every module's objects, about 0.5 s of a small merge on 2 cores. The output
    streams are flushed and JAX's pending effects awaited first. A process of a
    ``jax.distributed`` run exits normally (its shutdown tells the others). For the command
    line only (``python -m netutility_jax.cli``): never call it in a process that has more to
    do."""
    sys.stdout.flush()
    sys.stderr.flush()
    jax = sys.modules.get("jax")
    if jax is not None:
        initialized = getattr(jax.distributed, "is_initialized", None)
        if initialized is None or initialized():  # (an older JAX: exit normally)
            sys.exit(code)
        jax.effects_barrier()
    os._exit(code)


def _versions() -> str:
    """The versions a bug report needs: ours, JAX's and the other dependencies', Python's."""
    import platform

    from .._core.provenance import versions

    v = versions()
    parts = [f"{dist} {ver}" for dist, ver in v.items() if dist != "python"]
    parts.append(f"Python {v['python']} on {platform.platform(terse=True)}")
    return ", ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``netutility`` console script; returns the exit code.

    0: done. 2: bad input (the library's :class:`~netutility_jax.errors.NetUtilityError`, the
    command's :class:`.common.UsageError`, or an argparse error), printed as one line (an argparse
    error with a pointer to ``--help`` instead of the usage). 1: any other
    exception, a bug in netutility-jax: its traceback and a request to report it. 130:
    interrupted.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(demo_options=bool(argv) and argv[0] == "demo")
    args = parser.parse_args(argv)
    args.argv = argv  # recorded by the commands that write a report (the demo's results.json)
    if args.command == "merge":
        required_merge_arguments(parser, args)
    cmds: dict[str, Callable[[argparse.Namespace], int]] = {
        "merge": cmd_merge,
        "inspect": cmd_inspect,
        "convert": cmd_convert,
        "demo": cmd_demo,
    }
    try:
        if args.command != "demo":  # (the demo trains: compiled as JAX's defaults compile)
            cpu_compile_flags()
        cache = default_compile_cache()
        if not args.no_compile_cache and cache is not None:
            enable_compile_cache(cache)
        return cmds[args.command](args)
    except PeerLostError as e:  # JAX's shutdown barrier would wait for the lost process
        say(args.command, "error", one_line(e, MAX_MESSAGE))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
    except NetUtilityError as e:
        say(args.command, "error", one_line(e, MAX_MESSAGE))
        return 2
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        command = " ".join(shlex.quote(a) for a in [PROG, *argv])
        say(
            args.command,
            "internal error",
            "this is a bug in netutility-jax, not a problem with your input; please report it "
            f"with the traceback above, the command line ({one_line(Exception(command), 500)}) "
            f"and the versions ({_versions()})",
        )
        return 1


def run() -> None:
    """The ``netutility`` console script: :func:`main`, then :func:`exit_now` with its code."""
    exit_now(main())
