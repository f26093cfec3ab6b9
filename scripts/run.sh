#!/usr/bin/env bash
# The run command: install what is needed, then bring up a whole deployment
# (encoder + LLM engine + proxy) on the embedded tiny checkpoint, send one example
# request with an image, print the reply, and keep serving until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "${EPD_VENV:-.venv}/bin/epd" launch "$@"
