"""Launching the shard worker as a local subprocess: the embedded twin of a Kubernetes pod."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO

from airflow_deadline_batch.core.exit_codes import EXIT_RETRYABLE
from airflow_deadline_batch.core.failures import FailureClass, classify_exit
from airflow_deadline_batch.core.worker_command import POD_NAME_ENV, worker_arguments, worker_command
from airflow_deadline_batch.exceptions import ConfigurationError
from airflow_deadline_batch.store import ManifestStore

#: what SQLAlchemy shows instead of a password (``URL.render_as_string(hide_password=True)``)
MASKED_PASSWORD = ":***@"


@dataclass
class WorkerProcess:
    """A running worker and what is needed to fence it if it dies without releasing its lease."""

    job_id: str
    shard_index: int
    pool: str | None
    popen: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.popen.pid

    def signal(self, signum: int) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signum)


def worker_environment(store_url: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A worker's environment: this process's, the store URL, then the caller's ``env``, without
    ``ADB_POD_NAME`` (a shard pod's, which would rename the worker's attempts).

    The store URL travels in the environment, never in argv, so `ps` shows no credentials on a
    shared host. A caller's ``env`` wins: it carries the real URL when ``store_url`` is the
    masked one a ManifestStore shows (``user:***@host``), which can never log in and is refused.
    """
    full_env = dict(os.environ)
    full_env["ADB_STORE_URL"] = store_url
    if env:
        full_env.update(env)
    # a local worker is no pod, even when this process runs in one: it names its attempts
    # ``host:pid``, as :func:`launched_attempt` looks for them (a pod's name would hide them)
    full_env.pop(POD_NAME_ENV, None)
    if MASKED_PASSWORD in full_env["ADB_STORE_URL"]:
        raise ConfigurationError(
            "a worker would get the masked store URL (user:***@host) and could never log in: "
            "pass the real URL in env ADB_STORE_URL"
        )
    return full_env


def start_worker(
    store_url: str,
    job_id: str,
    shard_index: int,
    *,
    pool: str | None = None,
    lease_ttl_s: float = 60.0,
    grace_s: float = 30.0,
    env: Mapping[str, str] | None = None,
    stderr: IO[bytes] | int | None = None,
    worker_name: str | None = None,
    race: bool = False,
) -> WorkerProcess:
    full_env = worker_environment(store_url, env)
    argv = worker_command(
        sys.executable,
        worker_arguments(
            job_id,
            shard_index,
            pool=pool,
            lease_ttl_s=lease_ttl_s,
            grace_s=grace_s,
            worker_name=worker_name,
            extra=("--race",) if race else (),
        ),
    )
    popen = subprocess.Popen(
        argv, env=full_env, stdin=subprocess.DEVNULL, stderr=stderr, preexec_fn=die_with_parent()
    )
    return WorkerProcess(job_id, shard_index, pool, popen)


#: ``prctl`` option of linux/prctl.h: the signal a process gets when its parent dies
PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child die (SIGKILL) when this process dies, however it dies.

    A runner killed with SIGKILL cannot stop its workers; without this they would run on as
    orphans holding leases (docs/design.md §8: no worker outlives ``run``). Their leases then
    expire and a rerun takes the shards over at their committed cursors. ``None`` off Linux.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded before the fork, not in the child
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl: nobody will signal us
            os.kill(os.getpid(), signal.SIGKILL)

    return in_child


def launched_attempt(store: ManifestStore, proc: WorkerProcess) -> str | None:
    """The attempt this process claimed (the worker names its attempts ``host:pid``), if it did."""
    owner = f"{socket.gethostname()}:{proc.pid}"
    mine = [
        a for a in store.list_attempts(proc.job_id) if a.worker == owner and a.shard_index == proc.shard_index
    ]
    return mine[-1].attempt_id if mine else None


def fence_dead_worker(
    store: ManifestStore,
    proc: WorkerProcess,
    *,
    signalled: bool = False,
    failure: FailureClass | None = None,
    reason: str | None = None,
) -> bool:
    """After a worker died without releasing (a kill), end its attempt so a retry can claim now.

    The attempt ends with the death's class (docs/design.md §6.6): ``failure`` when the caller
    knows it, else read from the exit with ``signalled`` (did the caller send the kill: a
    preemption it injected, a drain): a kill it sent is ``preempted``, any other death by a signal
    a crash (``deterministic``, which spends the shard's budget). Only an attempt of *this* process
    (the worker names its attempts ``host:pid``) that still holds the lease is ended: a live worker
    of another launch that holds the shard is left alone.
    """
    attempt = launched_attempt(store, proc)
    if attempt is None:
        return False
    shard = store.get_shard(proc.job_id, proc.shard_index)
    if attempt not in (shard.lease_attempt_id, shard.race_attempt_id):  # its lease or its racing lease
        return False
    code = proc.popen.returncode
    if failure is None:
        failure = classify_exit(
            code if code is not None else -signal.SIGKILL, signalled_by_launcher=signalled
        )
    return store.abandon_attempt(
        proc.job_id,
        proc.shard_index,
        attempt,
        reason or f"worker pid {proc.pid} exited with {code}",
        failure=failure,
    )


def run_worker_subprocess(
    store_url: str,
    job_id: str,
    shard_index: int,
    *,
    pool: str | None = None,
    lease_ttl_s: float = 60.0,
    grace_s: float = 30.0,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run one worker to its end and return its exit code (0 / 75 / 1).

    If the process dies from a signal, its lease is fenced at once so the next try need not wait
    for the lease to expire; the result is reported as retryable (75).
    """
    proc = start_worker(
        store_url, job_id, shard_index, pool=pool, lease_ttl_s=lease_ttl_s, grace_s=grace_s, env=env
    )
    try:
        code = proc.popen.wait()
    except BaseException:
        # the Airflow task itself is being killed: pass the notice on, like a pod's SIGTERM
        proc.signal(signal.SIGTERM)
        try:
            proc.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.signal(signal.SIGKILL)
            proc.popen.wait()
        raise
    if code < 0:  # nobody here sent that signal: a crash or the OOM killer (deterministic)
        store = ManifestStore(store_url)
        fence_dead_worker(store, proc, signalled=False)
        return EXIT_RETRYABLE
    return code
