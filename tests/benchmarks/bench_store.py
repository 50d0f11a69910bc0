"""Benchmark: shard claim + commit + complete cycles per second on PostgreSQL, store vs raw SQL.

Both sides run the same protocol with the same number of worker processes: three transactions per
cycle (claim, one fenced microbatch commit, complete), each ONE statement sent in autocommit mode,
so one round trip per transaction on both sides. The baseline is the leanest hand-written SQL for
it: claim with ``UPDATE ... WHERE id = (SELECT ... FOR UPDATE SKIP LOCKED)`` (a partial index on
the pending rows keeps that O(1)), then fenced ``UPDATE``s (the commit row and the cursor bump in
one CTE statement). The target is a ratio of at least 0.5.

Remaining differences, on purpose: the store does more per statement (attempt rows, the job-state
check, lease TTLs and row stamps on the database clock, JSONB counts, the job's first-claim
transition) and goes through its pool and retry wrapper; it claims the shard index it is given
(that is the store's API: the runner assigns shards) where the raw loop finds the next pending row
with SKIP LOCKED. Each round also reports CPU per cycle: the workers' own (``process_time``,
summed) and, when the benchmark started the server itself, the server's (its processes' CPU time
from /proc), which depend less on other load on the machine than cycles per second do.

    .venv/bin/python tests/benchmarks/bench_store.py [--postgres-url URL] [--workers 16] [--cycles 100]

Without ``--postgres-url`` it starts a throwaway server with the test fixture's helpers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing as mp
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.fixtures.postgres import (  # noqa: E402
    admin_execute,
    create_database,
    find_pg_bin,
    start_cluster,
    stop_cluster,
    with_schema,
)

CTX = mp.get_context("fork")

RAW_SCHEMA = """
CREATE TABLE bench_shards (
    id integer PRIMARY KEY, state text NOT NULL, epoch integer NOT NULL, attempt_id text,
    lease_expires_at double precision, cursor integer NOT NULL
);
CREATE INDEX bench_shards_pending ON bench_shards (id) WHERE state = 'pending';
CREATE TABLE bench_commits (
    id integer NOT NULL, seq integer NOT NULL, attempt_id text NOT NULL, epoch integer NOT NULL,
    uri text NOT NULL, sha256 text NOT NULL, records integer NOT NULL, PRIMARY KEY (id, seq)
);
"""
RAW_CLAIM = """
UPDATE bench_shards SET state = 'leased', epoch = epoch + 1, attempt_id = %(attempt)s,
       lease_expires_at = extract(epoch from clock_timestamp()) + 60
 WHERE id = (SELECT id FROM bench_shards WHERE state = 'pending' ORDER BY id
              FOR UPDATE SKIP LOCKED LIMIT 1)
RETURNING id, epoch
"""
RAW_COMMIT = """
WITH fenced AS (
  UPDATE bench_shards SET cursor = cursor + 1
   WHERE id = %(id)s AND epoch = %(epoch)s AND attempt_id = %(attempt)s AND cursor = 0
     AND lease_expires_at > extract(epoch from clock_timestamp())
  RETURNING id, attempt_id, epoch
), committed AS (
  INSERT INTO bench_commits (id, seq, attempt_id, epoch, uri, sha256, records)
  SELECT id, 0, attempt_id, epoch, %(uri)s, %(sha)s, 1 FROM fenced
)
SELECT id FROM fenced
"""
RAW_COMPLETE = """
UPDATE bench_shards SET state = 'succeeded', lease_expires_at = NULL
 WHERE id = %(id)s AND epoch = %(epoch)s AND attempt_id = %(attempt)s AND cursor = 1
"""


def _dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _raw_worker(url: str, cycles: int, barrier: Any, done: Any) -> None:
    import psycopg

    with psycopg.connect(_dsn(url), connect_timeout=10, autocommit=True) as conn:
        barrier.wait(timeout=120)
        cpu = time.process_time()
        finished = 0
        while finished < cycles:
            attempt = uuid.uuid4().hex
            row = conn.execute(RAW_CLAIM, {"attempt": attempt}).fetchone()
            if row is None:
                break
            args = {
                "id": row[0],
                "epoch": row[1],
                "attempt": attempt,
                "uri": f"mem://{attempt}",
                "sha": "a" * 64,
            }
            if conn.execute(RAW_COMMIT, args).fetchone() is None:
                raise RuntimeError("raw commit was fenced")
            if conn.execute(RAW_COMPLETE, args).rowcount != 1:
                raise RuntimeError("raw complete was fenced")
            finished += 1
        cpu = time.process_time() - cpu
    done.put((finished, cpu))


def _store_worker(url: str, job_id: str, indexes: list[int], barrier: Any, done: Any) -> None:
    from airflow_deadline_batch.store import ManifestStore

    store = ManifestStore(url)
    store.db_time()  # connect before the clock starts
    barrier.wait(timeout=120)
    cpu = time.process_time()
    for index in indexes:
        lease = store.claim_shard(job_id, index, ttl_s=60, worker="bench")
        store.commit_microbatch(
            lease,
            seq=0,
            uri=f"mem://{lease.attempt_id}",
            sha256="a" * 64,
            records=1,
            counts={"succeeded": 1},
            prompt_tokens=1,
            completion_tokens=1,
            elapsed_s=0.0,
            model_digest=None,
        )
        store.complete_shard(lease)
    cpu = time.process_time() - cpu
    store.close()
    done.put((len(indexes), cpu))


@dataclass(frozen=True)
class Run:
    """One timed run: cycles per second, and CPU milliseconds per cycle (workers; server if known)."""

    cycles_per_s: float
    client_ms: float
    server_ms: float | None

    def __str__(self) -> str:
        server = "n/a" if self.server_ms is None else f"{self.server_ms:.3f}"
        return (
            f"{self.cycles_per_s:8.1f} cycles/s, CPU ms/cycle: workers {self.client_ms:.3f}, server {server}"
        )


def server_cpu_s(data_dir: Path | None) -> float | None:
    """CPU seconds so far of the server whose data folder is ``data_dir`` (its processes, live and reaped)."""
    if data_dir is None:
        return None
    postmaster = int((data_dir / "postmaster.pid").read_text().split()[0])
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile: its time is in the postmaster's reaped-children counters
            continue
        if int(entry.name) == postmaster:
            ticks += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
        elif int(fields[1]) == postmaster:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _wait_backends_gone(url: str) -> None:
    """Wait until the workers' server processes have exited (so their CPU time is counted)."""
    import psycopg

    deadline = time.monotonic() + 30
    with psycopg.connect(_dsn(url), autocommit=True, connect_timeout=10) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
            ).fetchone()
            if row is not None and row[0] == 0:
                return
            time.sleep(0.02)  # polling interval


def _timed(procs: list[Any], barrier: Any, done: Any, url: str, data_dir: Path | None) -> Run:
    for proc in procs:
        proc.start()
    barrier.wait(timeout=120)
    server_before = server_cpu_s(data_dir)
    start = time.perf_counter()
    results = [done.get(timeout=600) for _ in procs]
    elapsed = time.perf_counter() - start
    for proc in procs:
        proc.join(timeout=60)
        if proc.exitcode != 0:
            raise RuntimeError(f"benchmark worker exited with {proc.exitcode}")
    total = sum(n for n, _ in results)
    server_ms = None
    if server_before is not None:
        _wait_backends_gone(url)
        server_after = server_cpu_s(data_dir)
        assert server_after is not None
        server_ms = 1000 * (server_after - server_before) / total
    return Run(total / elapsed, 1000 * sum(cpu for _, cpu in results) / total, server_ms)


def bench_raw(url: str, workers: int, cycles: int, data_dir: Path | None = None) -> Run:
    schema = f"bench_raw_{uuid.uuid4().hex[:8]}"
    admin_execute(url, f"CREATE SCHEMA {schema}")
    scoped = with_schema(url, schema)
    try:
        admin_execute(scoped, *[s for s in RAW_SCHEMA.split(";") if s.strip()])
        admin_execute(
            scoped,
            f"INSERT INTO bench_shards SELECT g, 'pending', 0, NULL, NULL, 0 "
            f"FROM generate_series(0, {workers * cycles - 1}) g",
        )
        barrier, done = CTX.Barrier(workers + 1), CTX.Queue()
        procs = [
            CTX.Process(target=_raw_worker, args=(scoped, cycles, barrier, done)) for _ in range(workers)
        ]
        return _timed(procs, barrier, done, url, data_dir)
    finally:
        admin_execute(url, f"DROP SCHEMA {schema} CASCADE")


def bench_store(url: str, workers: int, cycles: int, data_dir: Path | None = None) -> Run:
    from airflow_deadline_batch.store import ManifestStore, NewJob, NewShard

    schema = f"bench_store_{uuid.uuid4().hex[:8]}"
    admin_execute(url, f"CREATE SCHEMA {schema}")
    scoped = with_schema(url, schema)
    try:
        store = ManifestStore.open(scoped)
        n = workers * cycles
        job, _ = store.create_job(
            NewJob(
                deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1),
                input_uri="mem://in",
                input_sha256="e" * 64,
                input_lines=n,
                input_total_lines=n,
                output_uri="mem://out",
                config={"max_attempts": 3},
            ),
            [
                NewShard(
                    shard_index=i,
                    byte_start=i,
                    byte_end=i + 1,
                    first_line=i + 1,
                    line_count=1,
                    records=1,
                    num_microbatches=1,
                    input_sha256="0" * 64,
                )
                for i in range(n)
            ],
        )
        store.close()
        barrier, done = CTX.Barrier(workers + 1), CTX.Queue()
        procs = [
            CTX.Process(
                target=_store_worker, args=(scoped, job.job_id, list(range(w, n, workers)), barrier, done)
            )
            for w in range(workers)
        ]
        run = _timed(procs, barrier, done, url, data_dir)
        check = ManifestStore(scoped)
        progress = check.progress(job.job_id)
        check.close()
        if progress.shards_by_state != {"succeeded": n} or progress.committed_records != n:
            raise RuntimeError(f"store benchmark left inconsistent state: {progress}")
        return run
    finally:
        admin_execute(url, f"DROP SCHEMA {schema} CASCADE")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--postgres-url", help="postgresql+psycopg:// URL (default: start a throwaway server)"
    )
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--cycles", type=int, default=100, help="cycles per worker")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each; the best counts")
    args = parser.parse_args(argv)

    cluster = None
    data_dir: Path | None = None
    url = args.postgres_url
    if url is None:
        if find_pg_bin() is None:
            print(
                "PostgreSQL binaries not found; install them with `apt-get install postgresql`",
                file=sys.stderr,
            )
            return 2
        cluster = start_cluster()
        url = create_database(cluster, "adb_bench")
        data_dir = cluster.data_dir
    print(
        f"workers={args.workers} cycles/worker={args.cycles} rounds={args.rounds} "
        "(claim + commit + complete per cycle)"
    )
    try:
        # Alternate the two and keep each one's best run: other load on the machine then hurts both alike.
        raws, stores = [], []
        for round_ in range(args.rounds):
            raws.append(bench_raw(url, args.workers, args.cycles, data_dir))
            stores.append(bench_store(url, args.workers, args.cycles, data_dir))
            print(f"round {round_ + 1}: raw {raws[-1]}")
            print(f"         store {stores[-1]}  (load average {os.getloadavg()[0]:.1f})")
    finally:
        if cluster is not None:
            stop_cluster(cluster)
    raw = max(r.cycles_per_s for r in raws)
    store = max(r.cycles_per_s for r in stores)
    print(f"raw SQL (SKIP LOCKED + fenced UPDATE): {raw:8.1f} cycles/s (best)")
    print(f"ManifestStore:                         {store:8.1f} cycles/s (best)")
    print(f"ratio store/raw: {store / raw:.2f} (target >= 0.5)")
    raw_cpu = min(r.client_ms + (r.server_ms or 0.0) for r in raws)
    store_cpu = min(r.client_ms + (r.server_ms or 0.0) for r in stores)
    scope = "workers + server" if data_dir is not None else "workers only"
    print(
        f"CPU ms/cycle ({scope}, least of each): raw {raw_cpu:.3f}, store {store_cpu:.3f}; "
        f"ratio raw/store {raw_cpu / store_cpu:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
