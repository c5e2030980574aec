#!/usr/bin/env bash
# The README's main job: set up (idempotent), then pretrain the tiny preset on
# the Python standard library's own source files, 2 CPU processes, cp_size 2.
# Extra arguments go to cp_rope.launch.pretrain (see --help). Each run writes a
# new runs/pretrain_cpu_<time> directory (a later --out-dir flag overrides it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BIN=""
[ "${CP_ROPE_VENV:-.venv}" = "none" ] || BIN="${CP_ROPE_VENV:-.venv}/bin/"
exec "${BIN}torchrun" --standalone --nproc-per-node 2 -m cp_rope.launch.pretrain --cp-size 2 \
    --out-dir "runs/pretrain_cpu_$(date -u +%Y%m%d_%H%M%S)" "$@"
