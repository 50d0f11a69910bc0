"""Benchmark: shard claim + commit + complete cycles per second on PostgreSQL, store vs raw SQL.

Both sides run the same protocol with the same number of worker processes and three transactions
per cycle (claim, one fenced microbatch commit, complete). The baseline is the leanest hand-written
SQL for it: claim with ``UPDATE ... WHERE id = (SELECT ... FOR UPDATE SKIP LOCKED)``, then fenced
``UPDATE``s. The store does more per cycle (attempt rows, job checks, database-clock leases), so
the target is a ratio of at least 0.5.

    .venv/bin/python tests/benchmarks/bench_store.py [--postgres-url URL] [--workers 16] [--cycles 100]

Without ``--postgres-url`` it starts a throwaway server with the test fixture's helpers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing as mp
import sys
import time
import uuid
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
RAW_COMMIT_INSERT = """
INSERT INTO bench_commits (id, seq, attempt_id, epoch, uri, sha256, records)
SELECT id, cursor, attempt_id, epoch, %(uri)s, %(sha)s, 1 FROM bench_shards
 WHERE id = %(id)s AND epoch = %(epoch)s AND attempt_id = %(attempt)s AND cursor = 0
   AND lease_expires_at > extract(epoch from clock_timestamp())
"""
RAW_COMMIT_CURSOR = "UPDATE bench_shards SET cursor = cursor + 1 WHERE id = %(id)s AND epoch = %(epoch)s"
RAW_COMPLETE = """
UPDATE bench_shards SET state = 'succeeded', lease_expires_at = NULL
 WHERE id = %(id)s AND epoch = %(epoch)s AND attempt_id = %(attempt)s AND cursor = 1
"""


def _dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _raw_worker(url: str, cycles: int, barrier: Any, done: Any) -> None:
    import psycopg

    with psycopg.connect(_dsn(url), connect_timeout=10) as conn:
        barrier.wait(timeout=120)
        finished = 0
        while finished < cycles:
            attempt = uuid.uuid4().hex
            with conn.transaction():
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
            with conn.transaction():
                if conn.execute(RAW_COMMIT_INSERT, args).rowcount != 1:
                    raise RuntimeError("raw commit was fenced")
                conn.execute(RAW_COMMIT_CURSOR, args)
            with conn.transaction():
                if conn.execute(RAW_COMPLETE, args).rowcount != 1:
                    raise RuntimeError("raw complete was fenced")
            finished += 1
    done.put(finished)


def _store_worker(url: str, job_id: str, indexes: list[int], barrier: Any, done: Any) -> None:
    from airflow_deadline_batch.store import ManifestStore

    store = ManifestStore(url)
    store.db_time()  # connect before the clock starts
    barrier.wait(timeout=120)
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
    store.close()
    done.put(len(indexes))


def _timed(procs: list[Any], barrier: Any, done: Any) -> tuple[int, float]:
    for proc in procs:
        proc.start()
    barrier.wait(timeout=120)
    start = time.perf_counter()
    total = sum(done.get(timeout=600) for _ in procs)
    elapsed = time.perf_counter() - start
    for proc in procs:
        proc.join(timeout=60)
        if proc.exitcode != 0:
            raise RuntimeError(f"benchmark worker exited with {proc.exitcode}")
    return total, elapsed


def bench_raw(url: str, workers: int, cycles: int) -> float:
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
        total, elapsed = _timed(procs, barrier, done)
        return total / elapsed
    finally:
        admin_execute(url, f"DROP SCHEMA {schema} CASCADE")


def bench_store(url: str, workers: int, cycles: int) -> float:
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
        total, elapsed = _timed(procs, barrier, done)
        check = ManifestStore(scoped)
        progress = check.progress(job.job_id)
        check.close()
        if progress.shards_by_state != {"succeeded": n} or progress.committed_records != n:
            raise RuntimeError(f"store benchmark left inconsistent state: {progress}")
        return total / elapsed
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
    try:
        # Alternate the two and keep each one's best run: other load on the machine then hurts both alike.
        raws, stores = [], []
        for _ in range(args.rounds):
            raws.append(bench_raw(url, args.workers, args.cycles))
            stores.append(bench_store(url, args.workers, args.cycles))
        raw, store = max(raws), max(stores)
    finally:
        if cluster is not None:
            stop_cluster(cluster)
    print(
        f"workers={args.workers} cycles/worker={args.cycles} rounds={args.rounds} (best run of each; "
        "claim + commit + complete per cycle)"
    )
    print(f"raw SQL (SKIP LOCKED + fenced UPDATE): {raw:8.1f} cycles/s")
    print(f"ManifestStore:                         {store:8.1f} cycles/s")
    print(f"ratio store/raw: {store / raw:.2f} (target >= 0.5)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
