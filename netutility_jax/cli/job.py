"""``netutility merge``'s arguments as one frozen job, made once from the parsed command line.

:func:`.config.resolve` completes the parsed namespace (``--config``, the tasks' names, the
checks of what goes together); :meth:`MergeJob.of` then turns it into the merge's
configuration (:class:`nu.MergeConfig`, :attr:`MergeJob.settings`: every setting, the method's
and space's options an explicit mapping of it) and the few arguments that are about this run
only (the folders, ``--out``, ``--dry-run``, ``--quiet``, the distributed run's flags). The
command then makes one call, :func:`nu.merge_folders`, with them.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ..folders import MergeConfig, MomentsFile
from .options import method_options

__all__ = ["MergeJob", "MomentsFile", "settings_of"]

#: The fields of :class:`nu.MergeConfig` that are one flag each (``dest``); ``names`` and
#: ``method_options`` are made apart.
_FLAGS = tuple(
    f.name for f in dataclasses.fields(MergeConfig) if f.name not in ("names", "method_options")
)


def settings_of(args: argparse.Namespace) -> MergeConfig:
    """The merge's configuration from the resolved flags: one field per flag, the method's and
    space's option flags checked (in the flags' terms) and gathered in ``method_options``."""
    options = method_options(args)
    values: dict[str, Any] = {name: getattr(args, name) for name in _FLAGS}
    if values["input_moments"] is not None:
        values["input_moments"] = tuple(values["input_moments"])
    names = getattr(args, "names", None)
    return MergeConfig(
        **values, names=None if names is None else tuple(names), method_options=options
    )


@dataclasses.dataclass(frozen=True)
class MergeJob:
    """What ``netutility merge`` was asked to do: the merge's :attr:`settings`, the tasks'
    adapters and names, the arguments about this run only, and the command line (``argv``,
    which the distributed supervisor records)."""

    adapters: tuple[str, ...]
    names: tuple[str, ...]
    settings: MergeConfig
    config: str | None
    out: str | None
    dry_run: bool
    quiet: bool
    no_compile_cache: bool
    distributed: bool
    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    keep_shards: bool
    distributed_timeout: float | None
    heartbeat_timeout: float | None
    argv: tuple[str, ...] = ()

    @classmethod
    def of(cls, args: argparse.Namespace) -> MergeJob:
        """The job of ``args``, a ``merge`` namespace completed by :func:`.config.resolve`."""
        special = {"adapters", "names", "settings", "argv"}
        plain = {f.name for f in dataclasses.fields(cls)} - special
        return cls(
            adapters=tuple(args.adapters),
            names=tuple(args.names),
            settings=settings_of(args),
            argv=tuple(getattr(args, "argv", None) or ()),
            **{name: getattr(args, name) for name in plain},
        )
