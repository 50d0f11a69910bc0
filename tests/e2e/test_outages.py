"""A bad hour never spoils a job (docs/design.md §6.6, §10): outages mid-job, deadline far away.

Real subprocess workers and the in-process runner go through a loopback fault proxy
(``tests.fixtures.faultproxy``) to a real PostgreSQL server and to the S3 API of a moto server.
Each test starts a job, waits until work is committed (a condition, not a clock), injects the
fault, waits until the workers felt it, keeps it for the scenario's length, heals it, and then
requires the job to complete with EVERY valid record ``succeeded``, verified, and no shard budget
spent by the outage:

* a 60 s S3 outage (the issue's number: connections refused and reset);
* a PostgreSQL restart (connections reset, new ones refused for several seconds): the runner's own
  store calls and the workers' ride it out;
* a full output disk for a spell (``ENOSPC`` through the worker's fault hook: a real full
  filesystem needs a mount, which the test machines do not allow).
"""

from __future__ import annotations

import datetime as dt
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from sqlalchemy.engine import make_url

from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.exceptions import ConfigurationError
from airflow_deadline_batch.local.runner import RunOptions, RunSummary, run_job
from airflow_deadline_batch.service.finalize import verify_job
from airflow_deadline_batch.service.planning import PlanRequest
from airflow_deadline_batch.store import ManifestStore
from tests.e2e.conftest import wait_for
from tests.fixtures.faultproxy import FaultProxy
from tests.helpers.inputs import MixedInput, mixed_input
from tests.helpers.outcomes import (
    assert_outcomes_match,
    assert_store_invariants,
    read_manifest,
    read_outcomes,
)

pytestmark = pytest.mark.e2e

#: the issue's outage length for S3
S3_OUTAGE_S = 60.0
#: a PostgreSQL restart: new connections refused this long after the open ones were reset
PG_RESTART_S = 6.0
#: a full disk: this long after a worker first met it
DISK_FULL_S = 5.0


class _Job:
    """``run_job`` in a thread, so the test can inject faults while it runs."""

    def __init__(self, store_url: str, request: PlanRequest, options: RunOptions) -> None:
        self.store = ManifestStore.open(store_url)
        self.summary: RunSummary | None = None
        self.error: BaseException | None = None
        self.job_id: str | None = None
        self.thread = threading.Thread(target=self._run, args=(request, options), daemon=True)

    def _run(self, request: PlanRequest, options: RunOptions) -> None:
        def planned(plan: Any) -> None:
            self.job_id = plan.job_id

        try:
            self.summary = run_job(self.store, request, options, on_plan=planned)
        except BaseException as exc:  # reported by finish()
            self.error = exc

    def start(self) -> _Job:
        self.thread.start()
        return self

    def committed(self) -> int:
        if self.job_id is None:
            return 0
        return sum(1 for c in self.store.list_commits(self.job_id) if c.shard_index >= 0)

    def finish(self, timeout_s: float) -> RunSummary:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the job did not finish within {timeout_s:.0f} s"
        if self.error is not None:
            raise self.error
        assert self.summary is not None
        return self.summary


def _request(tmp_path: Path, mixed: MixedInput, output_uri: str) -> PlanRequest:
    return PlanRequest(
        input_uri=str(mixed.write(tmp_path / "input.jsonl")),
        deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1),
        output_uri=output_uri,
        engine="echo",
        pools=default_local_pools("echo"),
        workers=2,
        microbatch_size=8,
        max_shards=6,
        # the outage must not spend it: a transient failure never does (docs/design.md §6.6)
        max_attempts=2,
        lease_ttl_s=6.0,
    )


def _options(tmp_path: Path, env: dict[str, str]) -> RunOptions:
    return RunOptions(
        workers=2,
        lease_ttl_s=6.0,
        backoff_cap_s=8.0,
        # each record takes real time, so a job outlives the instant its first commit is seen
        worker_env={"ADB_ECHO_DELAY_S": "0.01", **env},
        worker_log=str(tmp_path / "worker.log"),
    )


def _assert_every_record_succeeded(store: ManifestStore, summary: RunSummary, mixed: MixedInput) -> None:
    log_hint = f"summary {summary.to_dict()}"
    assert summary.state == "completed", log_hint
    assert summary.deadline_met, log_hint
    assert summary.manifest is not None
    manifest = read_manifest(summary.manifest)
    outcomes = read_outcomes(manifest)
    assert_outcomes_match(outcomes, mixed)  # every valid record succeeded, each line once
    expected_ok = sum(1 for e in mixed.expected if e.status == "succeeded")
    assert manifest["outcomes"]["succeeded"] == expected_ok > 0
    assert_store_invariants(store, summary.job_id, manifest)
    assert verify_job(store, summary.job_id).complete
    shards = store.list_shards(summary.job_id)
    assert all(s.failures == 0 for s in shards), [(s.shard_index, s.failures, s.last_error) for s in shards]


def _failure_classes(store: ManifestStore, job_id: str) -> list[str | None]:
    return [a.failure_class for a in store.list_attempts(job_id)]


def _hold(seconds: float) -> None:
    """Keep a fault for the scenario's length (the length of the outage, not a synchronisation)."""
    threading.Event().wait(seconds)


@pytest.fixture
def s3_proxy(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """A fault proxy in front of the moto server; this process and the workers use it."""
    url = urlsplit(s3_endpoint)
    with FaultProxy(url.hostname or "127.0.0.1", int(url.port or 80)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        yield proxy


def _through(proxy_port: int, store_url: str) -> str:
    return make_url(store_url).set(host="127.0.0.1", port=proxy_port).render_as_string(hide_password=False)


def _mid_job(job: _Job, what: str) -> None:
    wait_for(lambda: job.committed() >= 1, timeout_s=120, what=f"a first commit before {what}")


def test_a_60_s_s3_outage_mid_job_completes_every_record(
    tmp_path: Path, pg_store_url: str, s3_bucket: str, s3_proxy: FaultProxy
) -> None:
    mixed = mixed_input(240, seed=21, bad_fraction=0.0, blank_fraction=0.0)
    request = _request(tmp_path, mixed, f"s3://{s3_bucket}/out")
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{s3_proxy.port}"}
    job = _Job(pg_store_url, request, _options(tmp_path, env)).start()
    try:
        _mid_job(job, "the S3 outage")
        s3_proxy.outage()
        assert s3_proxy.wait_for_attempt(refused_at_least=3, timeout=120), "no worker met the outage"
        _hold(S3_OUTAGE_S)
        s3_proxy.heal()
        summary = job.finish(timeout_s=300)
        _assert_every_record_succeeded(job.store, summary, mixed)
        assert "transient" in _failure_classes(job.store, summary.job_id)
    finally:
        s3_proxy.heal()
        job.store.close()


def test_a_postgresql_restart_mid_job_completes_every_record(
    tmp_path: Path, pg_store_url: str, postgres_url: str
) -> None:
    target = make_url(pg_store_url)
    mixed = mixed_input(240, seed=22, bad_fraction=0.0, blank_fraction=0.0)
    request = _request(tmp_path, mixed, str(tmp_path / "out"))
    with FaultProxy(target.host or "127.0.0.1", int(target.port or 5432)) as proxy:
        job = _Job(_through(proxy.port, pg_store_url), request, _options(tmp_path, {})).start()
        try:
            _mid_job(job, "the PostgreSQL restart")
            proxy.outage()  # open connections reset, new ones refused: a server restarting
            assert proxy.wait_for_attempt(refused_at_least=5, timeout=120), "nobody met the restart"
            _hold(PG_RESTART_S)
            proxy.heal()
            summary = job.finish(timeout_s=300)
        finally:
            proxy.heal()
        check = ManifestStore.open(pg_store_url)
        try:
            _assert_every_record_succeeded(check, summary, mixed)
        finally:
            check.close()
            job.store.close()


def test_a_full_disk_mid_job_completes_every_record(tmp_path: Path, pg_store_url: str) -> None:
    mixed = mixed_input(240, seed=23, bad_fraction=0.0, blank_fraction=0.0)
    request = _request(tmp_path, mixed, str(tmp_path / "out"))
    flag = tmp_path / "disk-full"
    job = _Job(pg_store_url, request, _options(tmp_path, {"ADB_FAULT_DISK_FULL": str(flag)})).start()
    try:
        _mid_job(job, "the disk fills up")
        flag.touch()
        hit: Callable[[], bool] = lambda: Path(f"{flag}.hit").exists()  # noqa: E731
        wait_for(hit, timeout_s=120, what="a worker to meet the full disk")
        _hold(DISK_FULL_S)
        os.unlink(flag)
        summary = job.finish(timeout_s=300)
        _assert_every_record_succeeded(job.store, summary, mixed)
        assert "transient" in _failure_classes(job.store, summary.job_id)
    finally:
        if flag.exists():
            os.unlink(flag)
        job.store.close()


def test_a_configuration_error_stops_the_job_at_once_with_its_cause(tmp_path: Path) -> None:
    """docs/design.md §6.6: not every shard failing the same way until the deadline."""
    mixed = mixed_input(120, seed=24, bad_fraction=0.0, blank_fraction=0.0)
    request = _request(tmp_path, mixed, str(tmp_path / "out"))
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    options = _options(tmp_path, {"ADB_ECHO_DELAY_S": "-1"})  # an engine option no retry can fix
    try:
        with pytest.raises(ConfigurationError, match="delay_s_per_record") as err:
            run_job(store, request, options)
        job_id = err.value.fields.get("job_id") or store.list_jobs()[0].job_id
        job = store.get_job(job_id)
        assert job.state.value == "failed" and job.error and "configuration error" in job.error
        assert job.manifest_uri is None  # nothing published: no partial manifest
        tries = store.list_attempts(job_id)
        assert 1 <= len(tries) <= 2 * options.workers, [(a.shard_index, a.failure_class) for a in tries]
        assert "configuration" in {a.failure_class for a in tries}
    finally:
        store.close()
