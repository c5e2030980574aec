#!/usr/bin/env bash
# The torch-version matrix (issue 19): after .ci/run's full suite on the README's torch, one venv
# per further supported torch -- the oldest (pyproject's lower bound), 2.11 (what CUDA images
# ship) and the newest release -- each with the triton that torch pins, runs a fast slice:
# checkpoints and resume (tests/test_torch_versions.py, test_checkpoint_integrity.py without the
# slow end-to-end damage runs), the trainer (FSDP2 resume, bit for bit), data, transformers
# (finetune_hf save/resume), the RoPE kernel under TRITON_INTERPRET=1 and the CP attention tests.
# Each venv also resumes a checkpoint written by the main venv's torch, and the main venv one
# written by 2.11 (tests/test_torch_versions.py with CP_ROPE_OTHER_PYTHON).
#
# The venvs live outside the checkout, in $CP_ROPE_MATRIX_DIR (default ~/.cache/cp-rope/matrix),
# and are reused when they hold the wanted torch (a re-run costs no download); torch's CUDA wheels
# are the only ones the registry offers for these versions on Linux (they run on CPU). The
# machine's pip constraint file (a cap on torch) is replaced by one pinning the entry's torch.
#
# Environment: CP_ROPE_MATRIX="name=version ..." (default below; "none" skips the matrix),
# CP_ROPE_MAIN_PYTHON (the main venv's python, default .venv/bin/python), PYTHON (venv creator).
# Prints a table (install and test seconds per entry) and a final "matrix: N passed, N failed,
# N skipped" line over this run's junit files (and the main suite's, CP_ROPE_MAIN_JUNIT, when
# .ci/run passes it); exit status 1 if any entry failed to install, failed a test or ran no test.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
ENTRIES=${CP_ROPE_MATRIX:-"oldest=2.7.1 cuda-images=2.11.0 newest=2.15.0"}
DIR=${CP_ROPE_MATRIX_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/cp-rope/matrix}
MAIN_PY=${CP_ROPE_MAIN_PYTHON:-.venv/bin/python}  # made absolute, not through its links (a
case $MAIN_PY in  # venv's python is a link to the base interpreter, which lacks the venv)
  /*) ;;
  */*) MAIN_PY="$REPO/$MAIN_PY" ;;
  *) MAIN_PY=$(command -v "$MAIN_PY" || echo "$MAIN_PY") ;;
esac
export PIP_DISABLE_PIP_VERSION_CHECK=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev}
[ "$ENTRIES" = "none" ] && { echo "matrix: skipped (CP_ROPE_MATRIX=none)"; exit 0; }
mkdir -p "$DIR"
. scripts/pytest_workers.sh  # pytest-xdist workers in each venv (CP_ROPE_TEST_WORKERS)
check_test_workers || exit 4  # a bad CP_ROPE_TEST_WORKERS is refused before any install
RUN_TMP=$(mktemp -d)  # this run's junit files (the venvs' folder is shared by checkouts)

SLICE=(
  tests/test_torch_versions.py
  tests/test_checkpoint_integrity.py
  tests/test_pretrain.py::test_resume_bit_for_bit
  tests/test_pretrain.py::test_signal_saves_a_checkpoint_and_exits
  tests/test_data.py
  tests/test_hf.py
  tests/test_rope.py
  tests/test_attention.py
)
# the end-to-end damage cases and kill -9 run once, in the main suite (the library-level
# checks of the same code run here)
# checks of the same code run here); the RoPE grid runs its Triton cases at one CP rank (cp 2,
# rank 1: the zigzag halves), every dtype, rotary fraction and layout;
DESELECT="not test_resume_skips_a_damaged_newest_checkpoint and not test_kill_9"
DESELECT+=" and (not test_forward_backward_grid or (triton and cp2r1))"
# the 4-rank CP parities (attention, transformers) run in the main suite; cp 2 runs here
DESELECT+=" and not test_cp2_cp4_equal_unpatched and not (test_cp_attention_matches_single_process and 4)"

table=()
xmls=()
[ -n "${CP_ROPE_MAIN_JUNIT:-}" ] && [ -f "$CP_ROPE_MAIN_JUNIT" ] && xmls+=("$CP_ROPE_MAIN_JUNIT")
failed=0
other_for_main=""
for entry in $ENTRIES; do
  name=${entry%%=*}
  version=${entry#*=}
  venv="$DIR/torch-$version"
  py="$venv/bin/python"
  cons="$DIR/constraints-$version.txt"
  echo "torch==$version" > "$cons"
  echo "matrix[$name]: torch $version in $venv"
  t0=$(date +%s)
  # one run at a time per venv (checkouts share it; its editable install names one of them):
  # held through the install and the tests
  exec 9>"$venv.lock"
  flock 9
  ok=1
  have=$("$py" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)
  if [ "$have" != "$version" ]; then
    rm -rf "$venv"
    "${PYTHON:-python3}" -m venv "$venv" \
      && PIP_CONSTRAINT="$cons" "$py" -m pip install -q "torch==$version" || ok=0
  fi
  # where the venv's cp_rope.launch comes from, asked outside the checkout: from inside it, the
  # checkout's cp_rope/ is found through the working directory whatever the venv holds (a venv
  # whose editable install points at another checkout then ran a mix of both, or no launch)
  where=$(cd / && "$py" -c "import cp_rope.launch as m, os; print(os.path.dirname(os.path.dirname(m.__file__)))" 2>/dev/null || true)
  if [ $ok = 1 ] && [ "$where" != "$REPO" ]; then
    PIP_CONSTRAINT="$cons" "$py" -m pip install -q -e ".[test,hf]" || ok=0
  fi
  t1=$(date +%s)
  if [ $ok = 0 ]; then
    echo "matrix[$name]: FAILED to install torch $version" >&2
    table+=("$(printf '%-12s %-28s %8s %8s  %s' "$name" "$version" "$((t1 - t0))" "-" "FAILED to install")")
    failed=1
    exec 9>&-
    continue
  fi
  info=$("$py" -c "import torch, triton; print(torch.__version__, 'triton', triton.__version__)" 2>/dev/null || echo "$version")
  xml="$RUN_TMP/junit-$name.xml"
  pytest_workers "$py"
  CP_ROPE_OTHER_PYTHON="$MAIN_PY" "$py" -m pytest ${XDIST[@]+"${XDIST[@]}"} -q -p no:cacheprovider \
    --junitxml="$xml" "${SLICE[@]}" -k "$DESELECT"
  rc=$?
  exec 9>&-
  t2=$(date +%s)
  [ -f "$xml" ] && xmls+=("$xml")
  case $rc in
    0) verdict="ok" ;;
    5) verdict="ran no test (pytest exit 5: the slice's paths are stale)"; failed=1 ;;
    *) verdict="FAILED (pytest exit $rc)"; failed=1 ;;
  esac
  table+=("$(printf '%-12s %-28s %8s %8s  %s' "$name" "$info" "$((t1 - t0))" "$((t2 - t1))" "$verdict")")
  [ "$name" = "cuda-images" ] && other_for_main="$py"
done

# the main venv resumes a checkpoint written by torch 2.11
if [ -n "$other_for_main" ] && [ -x "$MAIN_PY" ]; then
  t1=$(date +%s)
  xml="$RUN_TMP/junit-main-resumes-2.11.xml"
  exec 9>"$(dirname "$(dirname "$other_for_main")").lock"
  flock 9
  CP_ROPE_OTHER_PYTHON="$other_for_main" "$MAIN_PY" -m pytest -q -p no:cacheprovider \
    --junitxml="$xml" tests/test_torch_versions.py -k another_torch
  rc=$?
  exec 9>&-
  t2=$(date +%s)
  [ -f "$xml" ] && xmls+=("$xml")
  [ $rc = 0 ] && verdict="ok" || { verdict="FAILED (pytest exit $rc)"; failed=1; }
  table+=("$(printf '%-12s %-28s %8s %8s  %s' "main<-2.11" "$("$MAIN_PY" -c 'import torch; print(torch.__version__)')" "-" "$((t2 - t1))" "$verdict")")
fi

echo
[ -n "${CP_ROPE_CI_T0:-}" ] && echo "ci: full suite + matrix took $(( $(date +%s) - CP_ROPE_CI_T0 )) s (after set-up)"
echo "matrix summary ($DIR)"
printf '%-12s %-28s %8s %8s  %s\n' "entry" "torch" "install" "tests" "result"
printf '%s\n' "${table[@]}"
python3 - "${xmls[@]}" <<'EOF'
import sys
import xml.etree.ElementTree as ET
tot = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for path in sys.argv[1:]:
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for k in tot:
            tot[k] += int(suite.get(k, 0))
bad = tot["failures"] + tot["errors"]
print(f"matrix: {tot['tests'] - bad - tot['skipped']} passed, {bad} failed, {tot['skipped']} skipped")
EOF
exit $failed
