"""``netutility merge``'s arguments as one frozen job: the merge's configuration and the
arguments about this run.

:func:`.config.resolve` makes the configuration from the flags and ``--config``
(:class:`nu.MergeConfig`, by :func:`settings_from`: every setting, the method's and space's
options an explicit mapping of it) and completes the arguments about the run; :meth:`MergeJob.of`
then holds them together with the few arguments that are about this run only (the folders,
``--out``, ``--dry-run``, ``--quiet``, the distributed run's flags). The command then makes
one call, :func:`nu.merge_folders`, with them.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ..folders import MergeConfig, MomentsFile
from .options import method_options

__all__ = ["MergeJob", "MomentsFile", "settings_from", "settings_of"]

#: The fields of :class:`nu.MergeConfig` that are one flag each (``dest``); ``names`` and
#: ``method_options`` are made apart.
_FLAGS = tuple(
    f.name for f in dataclasses.fields(MergeConfig) if f.name not in ("names", "method_options")
)


def settings_from(
    values: Mapping[str, Any], *, names: Sequence[str] | None, options: Mapping[str, Any]
) -> MergeConfig:
    """The merge's configuration: :meth:`nu.MergeConfig.from_dict` of the settings' values
    (``values``: by field, as the flags' ``dest`` spell them, ``chunk_mb``; None: the field's
    default), the tasks' ``names`` and the method's and space's ``options``."""
    plain: dict[str, Any] = {name: values.get(name) for name in _FLAGS}
    plain["names"] = None if names is None else tuple(names)
    return MergeConfig.from_dict({**plain, "method_options": dict(options)})


def settings_of(args: argparse.Namespace) -> MergeConfig:
    """The merge's configuration from the flags alone (no ``--config``): one field per flag,
    the method's and space's option flags checked (in the flags' terms) and gathered in
    ``method_options``."""
    return settings_from(
        vars(args), names=getattr(args, "names", None), options=method_options(args)
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
        """The job of ``args``, a ``merge`` namespace completed by :func:`.config.resolve`
        (its configuration ``args.settings``; without it, the flags' alone:
        :func:`settings_of`)."""
        special = {"adapters", "names", "settings", "argv"}
        plain = {f.name for f in dataclasses.fields(cls)} - special
        settings = getattr(args, "settings", None)
        return cls(
            adapters=tuple(args.adapters),
            names=tuple(args.names),
            settings=settings if settings is not None else settings_of(args),
            argv=tuple(getattr(args, "argv", None) or ()),
            **{name: getattr(args, name) for name in plain},
        )
