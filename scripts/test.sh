#!/usr/bin/env bash
# The README's test command: set up (idempotent), then run the whole suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k rope -x, or
# scripts/test.sh tests/test_rope.py -q for one file: without a path pytest runs
# pyproject's testpaths, tests/; "tests" is not prepended, or a path would add to it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=python3
[ "${CP_ROPE_VENV:-.venv}" = "none" ] || PY="${CP_ROPE_VENV:-.venv}/bin/python"
exec "$PY" -m pytest "$@"
