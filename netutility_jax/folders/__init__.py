"""PEFT adapter folders merged into a written PEFT folder in one call: :func:`merge_folders`
driven by a :class:`MergeConfig` (``nu.merge_folders``, ``nu.MergeConfig``). This is what
``netutility merge`` runs: the command turns its flags (or its ``--config`` file, or a report
it replays) into a :class:`MergeConfig` and calls :func:`merge_folders`.

The package's modules: the settings (``_config``: :class:`MergeConfig` and its plain-data form),
reading the inputs (``_load``: the folders, the notes about them, the input moments files),
the merge itself (``_run``), writing the output folder (``_write``: staging folder, report,
model card, plots; ``_shards``: a merge split between processes) and the inputs' digests a
report records (``_digests``).
"""

from __future__ import annotations

from ._config import MergeConfig as MergeConfig
from ._config import MomentsFile as MomentsFile
from ._config import option_key as option_key
from ._digests import ADAPTER_FILES as ADAPTER_FILES
from ._digests import adapter_digest as adapter_digest
from ._digests import clear_digests as clear_digests
from ._digests import file_digest as file_digest
from ._digests import file_identity as file_identity
from ._digests import seen_digest as seen_digest
from ._load import FACTOR_KEY as FACTOR_KEY
from ._load import coverage_summary as coverage_summary
from ._load import read_adapters as read_adapters
from ._load import read_moments as read_moments
from ._load import say_notes as say_notes
from ._load import skipped_summary as skipped_summary
from ._run import merge_folders as merge_folders
from ._run import merge_settings as merge_settings
from ._run import mesh_of as mesh_of
from ._run import writes_as_it_goes as writes_as_it_goes
from ._write import REPORT_NAME as REPORT_NAME
from ._write import STAGING_TAG as STAGING_TAG
from ._write import Terms as Terms
from ._write import chunk_steps as chunk_steps
from ._write import model_card as model_card
from ._write import report_dict as report_dict
from ._write import staging_name as staging_name
from ._write import step as step

__all__ = [
    "ADAPTER_FILES",
    "FACTOR_KEY",
    "REPORT_NAME",
    "STAGING_TAG",
    "MergeConfig",
    "MomentsFile",
    "Terms",
    "adapter_digest",
    "chunk_steps",
    "clear_digests",
    "coverage_summary",
    "file_digest",
    "file_identity",
    "merge_folders",
    "merge_settings",
    "mesh_of",
    "model_card",
    "option_key",
    "read_adapters",
    "read_moments",
    "report_dict",
    "say_notes",
    "seen_digest",
    "skipped_summary",
    "staging_name",
    "step",
    "writes_as_it_goes",
]
