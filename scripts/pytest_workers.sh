# Sourced by scripts/test.sh, .ci/run and scripts/test_matrix.sh.
#
# `check_test_workers` returns 4 (pytest's usage-error status), saying why, when
# CP_ROPE_TEST_WORKERS is set and is not a whole number from 1 to 999.
#
# `pytest_workers PY [ARGS...]` sets the array XDIST to the pytest-xdist arguments for
# interpreter PY, (-n N --dist loadscope), and says on stderr how many workers run and why.
# N = $CP_ROPE_TEST_WORKERS, default the cores this process may use (not OMP_NUM_THREADS,
# which nproc would follow), up to 4. loadscope keeps a test file's module-level caches, such as
# a built model, in one worker. XDIST is empty (one process) for:
#   - one worker; PY without xdist (the offline install has none);
#   - ARGS or PYTEST_ADDOPTS that choose workers themselves (-n, --numprocesses, -p no:xdist),
#     that need one process (--pdb, --trace, -s / --capture, -x / --exitfirst / --maxfail /
#     --stepwise: under xdist these show no output or stop with exit status 2, "interrupted";
#     --collect-only, which runs nothing);
#   - ARGS naming one test file or test id (a second worker would only add its start-up).
# Every spawned world in the suite rendezvouses through its own file or a free port, so the
# workers never share one.
check_test_workers() {
  local n=${CP_ROPE_TEST_WORKERS:-}
  if [ -n "$n" ] && ! [[ $n =~ ^[1-9][0-9]{0,2}$ ]]; then
    echo "CP_ROPE_TEST_WORKERS=$n: expected a whole number from 1 to 999 (1 runs one process)" >&2
    return 4
  fi
}

pytest_workers() {  # callers run check_test_workers first
  local py=$1 a n why="" tests=0
  shift
  XDIST=()
  # shellcheck disable=SC2086  # PYTEST_ADDOPTS is split into words, as pytest does
  for a in "$@" ${PYTEST_ADDOPTS:-}; do
    case $a in
      -n*|--numprocesses*|no:xdist|-pno:xdist) why="the arguments choose the workers" ;;
      --pdb|--trace|--capture*|--exitfirst|--maxfail*|--sw|--stepwise*|--sw-skip|--co|--collect-only)
        why="$a needs one process" ;;
      -*) [[ $a =~ ^-[qvl]*[sx][qvlsx]*$ ]] && why="$a needs one process" ;;
      *.py|*.py::*) tests=$((tests + 1)) ;;
    esac
    [ -n "$why" ] && break
  done
  n=${CP_ROPE_TEST_WORKERS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1)}
  [ -z "${CP_ROPE_TEST_WORKERS:-}" ] && [ "$n" -gt 4 ] && n=4
  [ -z "$why" ] && [ "$tests" = 1 ] && why="one test file or id"
  [ -z "$why" ] && [ "$n" -le 1 ] && why="one worker (CP_ROPE_TEST_WORKERS or cores)"
  [ -z "$why" ] && ! "$py" -c "import xdist" >/dev/null 2>&1 && why="pytest-xdist is not installed in $py"
  if [ -n "$why" ]; then
    echo "pytest: one process: $why" >&2
  else
    XDIST=(-n "$n" --dist loadscope)
    echo "pytest: $n pytest-xdist workers (CP_ROPE_TEST_WORKERS=1 for one process)" >&2
  fi
}
