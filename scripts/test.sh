#!/usr/bin/env bash
# The whole test suite on real parts: PostgreSQL (started by the fixtures as the postgres user),
# an S3 API over HTTP (moto server), subprocess workers, Airflow dag.test(), headless Chromium.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
# Debian packages the tests drive: PostgreSQL's server, and Chromium + ChromeDriver for the UI tests
missing=()
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)
[ -x /usr/bin/chromium ] || missing+=(chromium)
[ -x /usr/bin/chromedriver ] || missing+=(chromium-driver)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing Debian packages: ${missing[*]}" >&2
  sudo=; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq && $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# Three test processes (pytest-xdist), whole files each, on two cores: the e2e tests mostly wait on
# real processes and deadlines, so other files run beside them (19 minutes with three, 24 with two,
# measured on the same 2-core machine for the same 2,218 tests; 18 minutes with three for 2,440
# tests on 2026-12-02, and the suite is then CPU-bound: 29.5 CPU-minutes). ADB_TEST_WORKERS=0
# runs in one process; pytest arguments after these win (e.g. -n 0).
# NumPy's OpenBLAS starts a thread per core in every test process and its subprocesses: with three
# processes on two cores those threads spin against each other (one simulator test took 28 s of CPU
# with them, 7.8 s with one thread each). One thread per process unless the caller says otherwise.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest -n "${ADB_TEST_WORKERS:-3}" --dist loadfile "$@"
