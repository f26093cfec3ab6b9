#!/usr/bin/env bash
# The test command: install the test extra, lint, run the whole suite.
# pytest's exit code 5 (nothing collected) counts as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test || exit 1
VENV="${EPD_VENV:-.venv}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

"$VENV/bin/ruff" check epd tests bench scripts || exit 1
"$VENV/bin/python" -m epd.statemachine.diagram --check || exit 1

"$VENV/bin/python" -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing"
    exit 1
fi
exit "$rc"
