"""The tail race's tests: a paused primary try holds its shard until its racer has claimed."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable

from airflow_deadline_batch.exceptions import LeaseLost
from airflow_deadline_batch.store import Lease, ManifestStore
from tests.helpers.waiting import wait_for


def racer_claimed(store: ManifestStore, job_id: str, shard_index: int = 0) -> bool:
    """Whether a racer has claimed a racing lease on the shard (its attempt is speculative)."""
    return any(a.speculative for a in store.list_attempts(job_id) if a.shard_index == shard_index)


def renew_primary_lease(store: ManifestStore, job_id: str, shard_index: int = 0) -> None:
    """Renew the lease of the shard's primary (not racing) try, as its heartbeat thread would.

    The worker's fault pause (``ADB_FAULT_PAUSE_AFTER_WRITE``) stops its heartbeat (for the SIGSTOP
    tests on SQLite, where a stopped heartbeat could hold the write lock), so its lease lapsed one
    TTL into the pause, and a racer that had not claimed by then found "nothing to race" and exited
    0: on a loaded machine racers took 20 to 30 s to start, past leases of 10 and 20 s. A try that
    no longer holds the lease is left alone (a cancel or a commit may land first).
    """
    shard = store.get_shard(job_id, shard_index)
    tries = [a for a in store.list_attempts(job_id) if a.shard_index == shard_index and not a.speculative]
    if not tries or shard.lease_attempt_id != tries[-1].attempt_id:
        return
    lease = Lease(
        job_id=job_id,
        shard_index=shard_index,
        attempt_id=tries[-1].attempt_id,
        epoch=shard.epoch,
        expires_at=shard.lease_expires_at or 0.0,
        cursor=shard.cursor,
        num_microbatches=shard.num_microbatches,
    )
    with contextlib.suppress(LeaseLost):  # it ended between the read and the renewal
        store.heartbeat(lease, shard.lease_ttl_s or 10.0)


def renewing_the_paused_primary(
    store: ManifestStore, job_id: str, done: Callable[[], object], *, what: str, timeout_s: float
) -> None:
    """Wait for ``done`` (the racer's claim, a cancel), renewing the paused primary's lease on shard 0
    meanwhile (:func:`renew_primary_lease`): it holds the shard however slow the machine is."""

    def check() -> bool:
        if done():
            return True
        renew_primary_lease(store, job_id)
        return False

    wait_for(check, timeout_s=timeout_s, what=what)


def wait_racer_claimed(
    store: ManifestStore, job_id: str, racer: subprocess.Popen[bytes], *, timeout_s: float
) -> None:
    """Wait for the racer to claim its racing lease on shard 0 (or to end) beside the paused
    primary, whose lease is renewed meanwhile."""
    renewing_the_paused_primary(
        store,
        job_id,
        lambda: racer_claimed(store, job_id) or racer.poll() is not None,
        what="the racer's claim",
        timeout_s=timeout_s,
    )
