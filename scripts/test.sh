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
# Two test processes (pytest-xdist), whole files each: the e2e tests mostly wait on real processes,
# so the unit tests run beside them (about 14 minutes instead of 23 on two cores). ADB_TEST_WORKERS=0
# runs in one process; pytest arguments after these win (e.g. -n 0).
exec .venv/bin/python -m pytest -n "${ADB_TEST_WORKERS:-2}" --dist loadfile "$@"
