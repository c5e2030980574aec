#!/usr/bin/env bash
# The README's main job: set up (idempotent), then pretrain the tiny preset on
# the Python standard library's own source files, 2 CPU processes, cp_size 2.
# Extra arguments go to cp_rope.launch.pretrain (see --help). Each run writes a
# new runs/pretrain_cpu_<time> directory (a later --out-dir flag overrides it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# torchrun as a module of the venv's interpreter: a venv made with --system-site-packages
# over a system torch has no bin/torchrun of its own (and a bare torchrun is another Python)
PY=python3
[ "${CP_ROPE_VENV:-.venv}" = "none" ] || PY="${CP_ROPE_VENV:-.venv}/bin/python"
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m cp_rope.launch.pretrain --cp-size 2 \
    --out-dir "runs/pretrain_cpu_$(date -u +%Y%m%d_%H%M%S)" "$@"
