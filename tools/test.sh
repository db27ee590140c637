#!/usr/bin/env bash
# Sets up everything the test suite needs and runs it: the README's test command, and CI's.
#
#   tools/test.sh [pytest args]
#
# - a virtual environment in .venv (torch 2.13.0 CPU, the project with its test extras);
# - as root, the system packages some tests need when missing: chromium (HTML report check),
#   iproute2 (network-namespace tests), tmux (the live terminal view's test); the Slurm lab
#   installs its own packages (tests/slurm_lab/lab.sh);
# - the import contract (pyproject.toml's [tool.importlinter], see docs/architecture.md): a
#   broken contract fails the script before any test runs;
# - pytest; "no tests collected" (exit 5) is a failure, not a pass.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 -e ".[test]"

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

set +e
.venv/bin/python -m pytest -q -ra "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "tools/test.sh: pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
