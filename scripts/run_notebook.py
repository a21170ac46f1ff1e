"""Execute notebooks headless, each in a fresh temporary working directory; exit 1 on any error.

Usage: python scripts/run_notebook.py colabs/experiment.ipynb [...]   (what .ci/run does)
"""

from __future__ import annotations

import sys
import tempfile
import time

import nbclient
import nbformat


def main(paths: list[str]) -> int:
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as cwd:
            client = nbclient.NotebookClient(
                nb, kernel_name="python3", timeout=1800, resources={"metadata": {"path": cwd}}
            )
            try:
                client.execute()
            except nbclient.exceptions.CellExecutionError as e:
                print(f"{path}: failed\n{e}", file=sys.stderr)
                return 1
        print(f"{path}: ran in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
