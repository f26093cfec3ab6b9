#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian machine: system library for dlslime, a virtual
# environment, and the package (plus extras given as $1, e.g. "test").
set -euo pipefail
cd "$(dirname "$0")/.."

extras="${1:-}"
PY="${PYTHON:-python3}"
VENV="${EPD_VENV:-.venv}"

# dlslime's import needs libibverbs.so.1 even for its TCP backend.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
    echo "[setup] installing Debian's libibverbs1 (needed by dlslime)"
    if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment $VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
fi

spec="."
[ -n "$extras" ] && spec=".[$extras]"
stamp="$VENV/.epd-installed-${extras:-base}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "[setup] installing epd $spec (the first time this downloads torch, a few GB)"
    "$VENV/bin/pip" install -q -e "$spec"
    touch "$stamp"
fi
