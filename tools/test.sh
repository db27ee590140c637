#!/usr/bin/env bash
# Sets up everything the test suite needs and runs it: the README's test command, and CI's.
#
#   tools/test.sh [pytest args]           everything, as CI runs it
#   tools/test.sh --quick [pytest args]   the inner loop: unit-level tests and one end-to-end job
#
# - a virtual environment in .venv (torch 2.13.0 CPU, the project with its test extras);
# - as root, the system packages some tests need when missing: chromium (HTML report check),
#   iproute2 (network-namespace tests), tmux (the live terminal view's test); the Slurm lab
#   installs its own packages (tests/slurm_lab/lab.sh);
# - the import contract (pyproject.toml's [tool.importlinter], see docs/architecture.md), the
#   linter and the formatter's check (ruff, [tool.ruff]) and the type checker (mypy,
#   [tool.mypy]): a broken contract or any finding fails the script before any test runs (all
#   three tools report first, then it fails);
# - Python's bytecode cache on (PYTHONDONTWRITEBYTECODE unset: docs/testing.md);
# - pytest on TRACEML_TEST_WORKERS xdist workers (default 4, measured: docs/testing.md),
#   tests that share one real job kept on one worker (--dist loadgroup, tests/conftest.py);
#   in the full run, then the `serial` tests (faults with a bound of seconds) on as many
#   workers among themselves, in the order of tests/helpers/schedule.py (longest first,
#   evened out over the workers), then the `alone` tests (timing benchmarks, planted
#   figures) one at a time (docs/testing.md); at the end the 25 slowest tests of all three;
# - "no tests collected" (exit 5) is a failure: of any invocation of the full run without
#   arguments (each always has tests), and with arguments of all three together (a selection
#   may hold no serial test, or only serial ones). Your own -m: run pytest itself.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

quick=0
if [ "${1:-}" = "--quick" ]; then
  quick=1
  shift
fi

python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
# The install: uv (PyPI's wheel, into the venv) resolves and unpacks the same releases as pip,
# 9 s against 39 s into a new venv here (docs/testing.md). It reads no pip configuration: it is
# given pip's find-links only (where this machine keeps torch's CPU build; the rest of pip's
# configuration here caps torch, which is pinned), and torch pinned to the CPU build (+cpu),
# which PyPI does not have, so it fails rather than download a CUDA build, and pip installs
# instead, as it does where pip has no find-links. Neither compiles (pip: --no-compile): each
# module is compiled once, by the first process that imports it.
read -ra dirs <<< "${PIP_FIND_LINKS:-} $(.venv/bin/pip config get global.find-links 2>/dev/null || true)"
links=()
for dir in ${dirs[@]+"${dirs[@]}"}; do
  links+=(--find-links "$dir")
done
uv_install() {
  [ ${#links[@]} -gt 0 ] || return 1
  [ "$(.venv/bin/uv --version 2>/dev/null)" = "uv 0.13.9" ] \
    || .venv/bin/pip install -q --disable-pip-version-check --only-binary uv "uv==0.13.9" \
    || return 1
  .venv/bin/uv pip install -q --python .venv/bin/python "${links[@]}" torch==2.13.0+cpu -e ".[test]"
}
if ! uv_install; then
  echo "tools/test.sh: pip installs the environment (uv cannot: no find-links of pip's, or above)" >&2
  .venv/bin/pip install -q --no-compile --disable-pip-version-check torch==2.13.0 -e ".[test]"
fi

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=()
  command -v chromium >/dev/null || missing+=(chromium fonts-liberation)
  command -v ip >/dev/null || missing+=(iproute2)
  command -v tmux >/dev/null || missing+=(tmux)
  if [ ${#missing[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }
  fi
fi

.venv/bin/lint-imports --no-cache
checks=0
.venv/bin/ruff check --no-cache . || checks=1
.venv/bin/ruff format --check --no-cache . || checks=1
.venv/bin/mypy || checks=1
if [ "$checks" -ne 0 ]; then
  echo "tools/test.sh: ruff or mypy found something (above): no tests run until it is fixed" >&2
  exit 1
fi

# Python's bytecode cache on, whatever the caller's environment says: with
# PYTHONDONTWRITEBYTECODE=1 every process the suite starts (each rank, aggregator, launcher)
# compiles TraceML's sources again, and each xdist worker's collection rewrites and compiles
# every test module again (measured: docs/testing.md). The cache is __pycache__/ (git-ignored).
unset PYTHONDONTWRITEBYTECODE

workers="${TRACEML_TEST_WORKERS:-4}"
parallel=(-n "$workers" --dist loadgroup)
reports="$(mktemp -d)"
trap 'rm -rf "$reports"' EXIT

# pytest ARGS...: runs it; its exit code in $rc.
run_pytest() {
  set +e
  .venv/bin/python -m pytest -q -ra "$@"
  rc=$?
  set -e
}

if [ "$quick" = 1 ]; then
  run_pytest "${parallel[@]}" -m "(not slow and not serial and not alone) or smoke" "$@"
  if [ "$rc" -eq 5 ]; then
    echo "tools/test.sh: pytest collected no tests: that is a failure" >&2
    exit 1
  fi
  exit "$rc"
fi

# The serial tests after the parallel ones, side by side among themselves: mostly they wait
# out their faults (docs/testing.md has the measurements).
run_pytest "${parallel[@]}" -m "not serial and not alone" --junitxml="$reports/parallel.xml" "$@"
rc_parallel=$rc
run_pytest "${parallel[@]}" --no-loadscope-reorder -m serial --junitxml="$reports/serial.xml" "$@"
rc_serial=$rc
run_pytest -m alone --junitxml="$reports/alone.xml" "$@"
rc_alone=$rc
.venv/bin/python tools/slowest_tests.py 25 "$reports/parallel.xml" "$reports/serial.xml" \
  "$reports/alone.xml"

status=0
codes=("$rc_parallel" "$rc_serial" "$rc_alone")
for rc in "${codes[@]}"; do
  if [ "$status" -eq 0 ] && [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
    status=$rc  # the first failure's code
  fi
done
if [ "$status" -eq 0 ]; then
  empty=0
  for rc in "${codes[@]}"; do
    if [ "$rc" -eq 5 ]; then empty=$((empty + 1)); fi
  done
  if [ $# -eq 0 ] && [ "$empty" -gt 0 ]; then
    echo "tools/test.sh: a part of the full run collected no tests: that is a failure" >&2
    status=1
  elif [ "$empty" -eq "${#codes[@]}" ]; then
    echo "tools/test.sh: pytest collected no tests: that is a failure" >&2
    status=1
  fi
fi
exit "$status"
