# Sourced by scripts/test.sh, .ci/run and scripts/test_matrix.sh: `pytest_workers PY [ARGS...]`
# sets the array XDIST to the pytest-xdist arguments for interpreter PY, (-n N --dist loadscope)
# (N = $CP_ROPE_TEST_WORKERS, default the machine's cores up to 4; loadscope keeps a test file's
# module-level caches, such as a built model, in one worker), or to nothing: one worker, no xdist
# in PY (the offline install has none), or ARGS that choose workers themselves or need one
# process (-n, --numprocesses, -p no:xdist, --pdb, --trace). Returns 2, saying why, when
# CP_ROPE_TEST_WORKERS is not a whole number >= 1. Every spawned world in the suite rendezvouses
# through its own file or a free port, so the workers never share one.
pytest_workers() {
  local py=$1 a n
  shift
  XDIST=()
  n=${CP_ROPE_TEST_WORKERS:-}
  if [ -n "$n" ] && ! [[ $n =~ ^[1-9][0-9]*$ ]]; then
    echo "CP_ROPE_TEST_WORKERS=$n: expected a whole number >= 1 (1 runs one process)" >&2
    return 2
  fi
  for a in "$@"; do
    case $a in -n*|--numprocesses*|no:xdist|--pdb|--trace) return 0 ;; esac
  done
  if [ -z "$n" ]; then
    n=$(nproc 2>/dev/null || echo 1)
    [ "$n" -gt 4 ] && n=4
  fi
  [ "$n" -gt 1 ] || return 0
  "$py" -c "import xdist" >/dev/null 2>&1 || return 0
  XDIST=(-n "$n" --dist loadscope)
}
