#!/usr/bin/env bash
# The README's test command: set up (idempotent), then run the whole suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k rope -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=python3
[ "${CP_ROPE_VENV:-.venv}" = "none" ] || PY="${CP_ROPE_VENV:-.venv}/bin/python"
exec "$PY" -m pytest tests "$@"
