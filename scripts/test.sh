#!/usr/bin/env bash
# The README's test command: set up (idempotent), then run the whole suite, on one pytest-xdist
# worker per core up to 4 (scripts/pytest_workers.sh; CP_ROPE_TEST_WORKERS=1 runs one process).
# Extra arguments go to pytest (e.g. scripts/test.sh -k rope -x, or
# scripts/test.sh tests/test_rope.py -q for one file: without a path pytest runs
# pyproject's testpaths, tests/; "tests" is not prepended, or a path would add to it).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pytest_workers.sh  # pytest-xdist workers (CP_ROPE_TEST_WORKERS=1: one process)
check_test_workers || exit 4  # before set-up
bash scripts/setup.sh
PY=python3
[ "${CP_ROPE_VENV:-.venv}" = "none" ] || PY="${CP_ROPE_VENV:-.venv}/bin/python"
pytest_workers "$PY" "$@"
exec "$PY" -m pytest ${XDIST[@]+"${XDIST[@]}"} "$@"
