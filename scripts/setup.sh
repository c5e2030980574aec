#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtual environment in .venv (it sees
# the system's packages, so a CUDA build of torch you already have is kept),
# PyTorch only when it is missing (the CPU wheel 2.13.0 by default), then
# cp-rope itself, editable, with its test, hf, plot and trl extras (pytest, hypothesis, ruff;
# transformers for cp_rope.hf; matplotlib for report.png; TRL, accelerate and datasets for
# cp_rope.hf.prepare's tests; without network: the package alone, --no-deps
# --no-build-isolation). Safe to run again.
# Everything runs from this install: no PYTHONPATH=. anywhere.
#
# Environment: PYTHON (default python3), CP_ROPE_VENV (default .venv; set to
# "none" to install into the current interpreter), CP_ROPE_TORCH_SPEC
# (default torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${CP_ROPE_VENV:-.venv}
if [ "$VENV" != "none" ]; then
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv --system-site-packages "$VENV"
  fi
  PY="$VENV/bin/python"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
if "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "setup: keeping installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  spec=${CP_ROPE_TORCH_SPEC:-torch==2.13.0}
  echo "setup: torch missing, installing $spec"
  "$PY" -m pip install -q "$spec" \
    || "$PY" -m pip install -q --index-url https://download.pytorch.org/whl/cpu torch
fi
if ! "$PY" -m pip install -q -e ".[test,hf,plot,trl]"; then
  # Offline: the package alone, with the build tools already installed.
  echo "setup: installing the test extra failed (no network?); installing cp-rope alone" >&2
  "$PY" -m pip install -q --no-deps --no-build-isolation -e .
fi
# A missing dependency fails here, named (the offline fallback above installs none of them):
# a core one is an error, a missing extra that CI uses a warning line.
"$PY" - <<'EOF'
import importlib.metadata as md, re, sys
missing = {}
for req in md.requires("cp-rope") or []:
    name, extra = re.match(r"[A-Za-z0-9._-]+", req).group(0), re.search(r"extra == .(\w+)", req)
    if "platform_system" in req and sys.platform != "linux":
        continue
    try:
        md.version(name)
    except md.PackageNotFoundError:
        missing.setdefault(extra.group(1) if extra else "core", []).append(name)
for extra in ("test", "hf", "plot", "trl"):
    if missing.get(extra):
        print(f"setup: warning: the [{extra}] extra is not installed: {missing[extra]}", file=sys.stderr)
if missing.get("core"):
    sys.exit(f"setup: cp-rope's dependencies are not installed: {missing['core']} (pip install them)")
EOF
"$PY" -c "import cp_rope, cp_rope.parallel, cp_rope.launch, torch; print('setup: cp_rope', cp_rope.__version__, 'with torch', torch.__version__)"
