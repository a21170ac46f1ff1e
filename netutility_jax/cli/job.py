"""``netutility merge``'s arguments as one frozen job, made once from the parsed command line.

:func:`.config.resolve` completes the parsed namespace (``--config``, the tasks' names, the
checks of what goes together); :meth:`MergeJob.of` then freezes it, and every step of the merge
(checking, loading, merging, writing, the distributed steps) reads the job, which none of them
can change. The method and space options' flags, derived from the registry, are read as
attributes too (``job.density``), as on the namespace; :func:`.args.method_options` turns them
into :func:`nu.merge_adapters`' options.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
from collections.abc import Mapping
from typing import Any, NamedTuple

from .args import option_names

__all__ = ["MergeJob", "MomentsFile"]


class MomentsFile(NamedTuple):
    """One ``--input-moments`` file, as :func:`.config.resolve` checked it."""

    path: str
    sha256: str  # of its bytes: the merge reads these bytes or stops; the report records it


@dataclasses.dataclass(frozen=True)
class MergeJob:
    """What ``netutility merge`` was asked to do: one field per flag (its ``dest``), the tasks'
    adapters and names, and the command line (``argv``, which the report and the distributed
    supervisor record)."""

    adapters: tuple[str, ...]
    names: tuple[str, ...]
    config: str | None
    out: str | None
    budget: int | None
    dry_run: bool
    weights: tuple[float, ...] | None
    min_share: float | None
    method: str
    space: str
    allocation: str
    scope: str | None
    alpha: float | str
    lam: float | str
    interference: str
    strict_targets: bool
    allow_different_base: bool
    skip_non_lora: bool
    no_compile_cache: bool
    keep_nonpositive: bool
    coef: float
    seed: int
    rank: int | None
    dtype: str
    serving_ranks: str | tuple[int, ...] | None
    in_memory: bool
    chunk_mb: float
    devices: str | int
    no_plots: bool
    quiet: bool
    distributed: bool
    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    keep_shards: bool
    distributed_timeout: float | None
    heartbeat_timeout: float | None
    option_flags: Mapping[str, Any]
    """The registry's method and space options' flags by name, as given (None or False: not
    given); read as attributes (``job.density``)."""
    argv: tuple[str, ...] = ()
    input_moments: tuple[MomentsFile | None, ...] | None = None
    """``--input-moments``: per adapter its file and the digest :func:`.config.resolve` took
    of it (None: that task data-free), or None without the flag."""

    @classmethod
    def of(cls, args: argparse.Namespace) -> MergeJob:
        """The job of ``args``, a ``merge`` namespace completed by :func:`.config.resolve`."""
        special = {"adapters", "names", "option_flags", "argv", "input_moments"}
        plain = {f.name for f in dataclasses.fields(cls)} - special
        moments = getattr(args, "input_moments", None)
        return cls(
            adapters=tuple(args.adapters),
            names=tuple(args.names),
            option_flags=types.MappingProxyType(
                {n: getattr(args, n, None) for n in option_names()}
            ),
            argv=tuple(getattr(args, "argv", None) or ()),
            input_moments=None if moments is None else tuple(moments),
            **{name: getattr(args, name) for name in plain},
        )

    def __getattr__(self, name: str) -> Any:
        # (called only for names that are not fields: the option flags)
        if name != "option_flags" and name in self.option_flags:
            return self.option_flags[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
