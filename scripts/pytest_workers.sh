# Sourced by scripts/test.sh, .ci/run and scripts/test_matrix.sh: `pytest_workers PY [ARGS...]`
# prints the pytest-xdist arguments for interpreter PY, "-n N --dist loadscope" (N =
# $CP_ROPE_TEST_WORKERS, default the machine's cores up to 4; loadscope keeps a test file's
# module-level caches, such as a built model, in one worker), or nothing: one worker, no xdist
# in PY (the offline install has none), or ARGS that choose workers themselves or need one
# process (-n, --numprocesses, -p no:xdist, --pdb, --trace). Every spawned world in the suite
# rendezvouses through its own file or a free port, so the workers never share one.
pytest_workers() {
  local py=$1 a n
  shift
  for a in "$@"; do
    case $a in -n*|--numprocesses*|no:xdist|--pdb|--trace) return 0 ;; esac
  done
  n=${CP_ROPE_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}
  [ -z "${CP_ROPE_TEST_WORKERS:-}" ] && [ "$n" -gt 4 ] && n=4
  [ "$n" -gt 1 ] 2>/dev/null || return 0
  "$py" -c "import xdist" >/dev/null 2>&1 || return 0
  echo "-n $n --dist loadscope"
}
