"""What ``netutility merge`` shows while it writes: the progress bar of its steps
(:func:`progress`). The output folder itself (adapter, report, model card, plots, assembled in
a staging folder and renamed into place) is written by :func:`nu.merge_folders`; its report's
name and form are re-exported here (:data:`REPORT_NAME`, :func:`report_dict`,
:func:`model_card`).
"""

from __future__ import annotations

import sys

from ..folders import REPORT_NAME, model_card, report_dict

__all__ = ["REPORT_NAME", "model_card", "progress", "report_dict"]


def progress(total: int, desc: str, quiet: bool):
    """A progress bar of ``total`` steps on stderr; None if ``quiet`` or tqdm is missing."""
    if quiet:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=False)
