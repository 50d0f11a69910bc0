#!/usr/bin/env bash
# The whole test suite on real parts: PostgreSQL (started by the fixtures as the postgres user),
# an S3 API over HTTP (moto server), subprocess workers, Airflow dag.test().
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  echo "installing PostgreSQL server binaries (Debian package postgresql)" >&2
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq postgresql >/dev/null;
  else sudo apt-get update -qq && sudo apt-get install -y -qq postgresql >/dev/null; fi
fi
exec .venv/bin/python -m pytest "$@"
