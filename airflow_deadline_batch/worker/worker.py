"""The shard worker: claim a shard, generate its microbatches, commit each one fenced by the lease.

It runs inside a Kubernetes pod (or as a local subprocess) and follows docs/design.md §6:

1. claim the shard (a CAS that bumps the lease epoch and records a fresh attempt ID);
2. check the engine's model digest against the job's pin, read the shard's byte range of the input
   and check its SHA-256, parse its records (skipping the lines the planner excluded);
3. order the records by estimated prompt length, cut microbatches of ``microbatch_size`` and, from
   the shard's cursor on, for each: generate, write one attempt-scoped object, commit it under the
   lease epoch; a background thread heartbeats every ``ttl / 3``;
4. on SIGTERM (a preemption notice) take no new microbatch, finish the current one only if it
   should fit in the grace period, release the lease and exit retryable; a second SIGTERM or a
   SIGINT releases and exits at once;
5. complete the shard.

With ``--race`` the worker is a speculative duplicate at the job's tail (issue 13): it takes a
racing lease beside the running attempt's (``ManifestStore.claim_race``) and runs the shard from
the cursor. Whichever of the two commits a microbatch first wins it; the other's commit is
refused, the store ends that attempt as ``lost_race``, and its worker exits 0: the shard is in
the other's hands, nothing failed and nothing is retried. A worker whose rival completed the
shard exits 0 the same way. A racer that finds nothing to race (no live lease, a racer already
there, every microbatch committed) exits 0 too.

A worker that finds its lease gone while alive (it stalled past its TTL: SIGSTOP, a GC pause, a
partition; or its job was stopped) ends its attempt as ``stalled``, over the ``lost_lease`` the
store wrote if another claim took the shard first: not a preemption of its pool (docs/design.md
§4.4); it exits 75 like any retryable end.

An engine that hangs (a microbatch's engine call past ``--stall-timeout``; by default ten times
its expected time, at least 30 minutes) ends its try as *deterministic*, from the heartbeat
thread, which otherwise would keep the hung worker's lease alive for ever (``_watchdog``). An
engine result that cannot be recorded as it is (not valid Unicode, a non-finite number, a shape
the result format does not allow) errors its own record, never its whole microbatch, and an
engine that calls ``sys.exit`` fails its try instead of exiting with its code.

Exit codes: 0 done (also when the shard was already committed), 75 retryable (preempted, lease
lost or held by another live attempt, transient failure), 1 terminal (bad configuration, model
digest mismatch, changed input, attempts exhausted).

Fault-injection hooks for tests (environment variables; nothing happens unless they are set;
``ADB_FAULT_KILL_AFTER_WRITE_PROB=p`` SIGKILLs the worker after an object write, before its commit):

``ADB_FAULT_PAUSE_AFTER_WRITE=<path>``
    After writing the object of microbatch ``ADB_FAULT_PAUSE_BEFORE_COMMIT_SEQ`` (default 0) and
    before committing it: stop heartbeating, create ``<path>`` (holding ``"<pid> <seq>"``), then
    block until ``<path>.resume`` exists (forever if nobody creates it), then heartbeat again and
    commit. A test synchronises on the file to SIGKILL or SIGSTOP the worker exactly between write
    and commit; with the heartbeat stopped first, a stopped worker never holds a database lock.

``ADB_FAULT_DISK_FULL=<path>``
    While ``<path>`` exists, writing a microbatch object fails as a full disk does (``ENOSPC``,
    wrapped in ``StorageError`` as the storage layer wraps it), and ``<path>.hit`` is created, so a
    test can wait until a worker met the full disk before it frees it.

How a try failed is classified once (``core.failures``, docs/design.md §6.6) and recorded on the
attempt (``failure_class``); the worker also writes it as one JSON line (``TryFailure``) to
``$ADB_TERMINATION_LOG``, or to Kubernetes' ``/dev/termination-log`` when that exists, so the
launcher and the pod operator read the class instead of guessing it from the exit code.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import functools
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import orjson

from airflow_deadline_batch.core.clock import MAX_SECONDS
from airflow_deadline_batch.core.estimate import estimate_prompt_tokens
from airflow_deadline_batch.core.exit_codes import EXIT_OK, EXIT_RETRYABLE, EXIT_TERMINAL
from airflow_deadline_batch.core.failures import FailureClass, TryFailure, classify_exception, exit_code_for
from airflow_deadline_batch.core.ids import shard_id as display_shard_id
from airflow_deadline_batch.core.packing import microbatch_count, microbatch_order
from airflow_deadline_batch.core.records import Record
from airflow_deadline_batch.core.results import ResultRecord, Usage, encode_results
from airflow_deadline_batch.core.shard_input import limits_from_config, parse_shard
from airflow_deadline_batch.core.states import AttemptOutcome, ShardState
from airflow_deadline_batch.core.worker_command import POD_NAME_ENV
from airflow_deadline_batch.exceptions import (
    ChecksumMismatch,
    ConfigurationError,
    EngineError,
    LeaseLost,
    ObjectNotFound,
    ShardNotClaimable,
    StorageError,
    StoreError,
)
from airflow_deadline_batch.storage import open_storage, open_uri, sha256_hex
from airflow_deadline_batch.store import JobRow, Lease, ManifestStore, ShardRow
from airflow_deadline_batch.worker.engines import Engine, Generation, GenerationParams, get_engine
from airflow_deadline_batch.worker.engines.base import ENGINE_ERROR, check_structured

#: the worker's exit codes (docs/design.md §6), defined once in core.exit_codes
EXIT_DONE = EXIT_OK
#: Without ``--stall-timeout``, a microbatch whose engine call runs longer than this many times its
#: expected time (the pace measured on this try's microbatches, else the planner's estimate), and
#: at least :data:`STALL_FLOOR_S`, is an engine that hangs: the try ends (see ``Heartbeat``).
STALL_FACTOR = 10.0
STALL_FLOOR_S = 1800.0

ENV_PAUSE_AFTER_WRITE = "ADB_FAULT_PAUSE_AFTER_WRITE"
ENV_PAUSE_SEQ = "ADB_FAULT_PAUSE_BEFORE_COMMIT_SEQ"
ENV_KILL_AFTER_WRITE = "ADB_FAULT_KILL_AFTER_WRITE_PROB"
ENV_DISK_FULL = "ADB_FAULT_DISK_FULL"
#: where the worker writes one JSON line saying how its try failed (core.failures.TryFailure)
ENV_TERMINATION_LOG = "ADB_TERMINATION_LOG"
#: Kubernetes' default ``terminationMessagePath``: the pod operator reads it from the pod status
K8S_TERMINATION_LOG = "/dev/termination-log"


log = logging.getLogger("airflow_deadline_batch.worker")


def default_worker_name() -> str:
    """The name a worker records with its attempts: ``<pod name>:<pid>`` in a shard pod, whose
    ``ADB_POD_NAME`` the pod operator sets from the downward API (the pod's hostname may be another:
    the node's with ``hostNetwork``), else ``<hostname>:<pid>`` (a local subprocess, a bare CLI run).
    The pod operator traces a pod's attempts by it (docs/kubernetes.md)."""
    return f"{os.environ.get(POD_NAME_ENV) or socket.gethostname()}:{os.getpid()}"


def object_key(attempt_id: str, shard_index: int, seq: int) -> str:
    """Key of a microbatch object, relative to the job's output base (docs/internals.md)."""
    return f"attempts/{attempt_id}/shard-{shard_index:05d}-mb-{seq:06d}.jsonl"


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """What one worker process is told on its command line."""

    store_url: str
    job_id: str
    shard_index: int
    lease_ttl_s: float | None = None  # None: the job's configured lease TTL
    grace_s: float = 30.0
    pool: str | None = None
    worker_name: str = field(default_factory=default_worker_name)
    engine_options: Mapping[str, str] = field(default_factory=dict)
    #: a speculative duplicate beside the shard's running attempt (the tail race)
    race: bool = False
    #: the longest an engine call (the load, one microbatch) may run (None: the load is not
    #: watched, a microbatch may run STALL_FACTOR times its expected time, at least STALL_FLOOR_S)
    stall_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not self.store_url:
            raise ConfigurationError("no manifest store: pass --store URL or set ADB_STORE_URL")
        if self.shard_index < 0:
            raise ConfigurationError(f"--shard must be >= 0, got {self.shard_index}")
        if self.lease_ttl_s is not None and not 0 < self.lease_ttl_s <= MAX_SECONDS:
            raise ConfigurationError(
                f"--lease-ttl must be a number of seconds > 0 and <= {MAX_SECONDS:g}, got {self.lease_ttl_s}"
            )
        if not 0 <= self.grace_s <= MAX_SECONDS:
            raise ConfigurationError(
                f"--grace must be a number of seconds >= 0 and <= {MAX_SECONDS:g}, got {self.grace_s}"
            )
        if self.stall_timeout_s is not None and not 0 < self.stall_timeout_s <= MAX_SECONDS:
            raise ConfigurationError(
                f"--stall-timeout must be a number of seconds > 0 and <= {MAX_SECONDS:g}, "
                f"got {self.stall_timeout_s}"
            )


class _Interrupted(BaseException):
    """Control flow, not an error: a signal asked the worker to stop now (release, exit 75).

    A ``BaseException`` (like ``KeyboardInterrupt``) so engine code that catches ``Exception``
    cannot swallow it.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Phase(str, enum.Enum):
    STARTING = "starting"
    LOADING = "loading"
    GENERATING = "generating"
    WRITING = "writing"
    COMMITTING = "committing"
    FINISHING = "finishing"


@dataclass(frozen=True)
class ShardInput:
    """The records of one shard in microbatch order, and the microbatch size."""

    records: tuple[Record, ...]
    microbatch_size: int

    def microbatch(self, seq: int) -> tuple[Record, ...]:
        return self.records[seq * self.microbatch_size : (seq + 1) * self.microbatch_size]


# ------------------------------------------------------------------------------------- pure helpers


def order_for_microbatches(records: Sequence[Record]) -> tuple[Record, ...]:
    """Length-aware order (estimated prompt tokens, ties by line): deterministic for every attempt."""
    order = microbatch_order([estimate_prompt_tokens(r.request) for r in records])
    return tuple(records[i] for i in order)


def result_records(
    records: Sequence[Record],
    generations: Sequence[Generation | None],
    rejected: Mapping[int, str],
    *,
    shard_index: int,
    attempt_id: str,
) -> list[ResultRecord]:
    """One result per record: its generation, or an ``invalid_record`` error for bad parameters.

    A generation that cannot be recorded as it is (text that is not valid Unicode, such as a lone
    surrogate an endpoint's JSON escapes can carry; a finish reason or choices the result format
    does not allow; a count beyond 64 bits; a log probability that is not a finite number, which
    JSON cannot carry) becomes that record's ``engine_error``: one hostile output must not fail
    its whole microbatch, try after try, and so every record of the shard (docs/design.md §4.2).
    """
    sid = display_shard_id(shard_index)
    results = []
    for pos, (record, gen) in enumerate(zip(records, generations, strict=True)):
        if pos in rejected or gen is None:
            results.append(
                ResultRecord.failed(
                    line=record.line,
                    id=record.id,
                    code="invalid_record",
                    message=rejected.get(pos, "no generation"),
                    shard_id=sid,
                    attempt_id=attempt_id,
                )
            )
            continue
        usage = _usage(gen)
        result: ResultRecord | None = None
        try:
            if usage is None:
                raise TypeError("the token usage is not a pair of counts")
            result = _generation_result(record, gen, usage, sid, attempt_id)
            unrecordable = _unrecordable(result)
        except (TypeError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            unrecordable = _why_invalid(exc)
        if result is None or unrecordable is not None:
            failed = functools.partial(
                ResultRecord.failed,
                line=record.line,
                id=record.id,
                code=ENGINE_ERROR,
                message=f"the engine's result cannot be recorded: {unrecordable}",
                shard_id=sid,
                attempt_id=attempt_id,
            )
            # the tokens were spent: keep the usage unless it is what cannot be recorded
            result = failed(usage=usage)
            if _unrecordable(result) is not None:
                result = failed()
        results.append(result)
    return results


def _usage(gen: Generation) -> Usage | None:
    """The generation's token usage (negative counts as 0), or None when it is not a pair of counts."""
    try:
        return Usage(prompt_tokens=max(0, gen.prompt_tokens), completion_tokens=max(0, gen.completion_tokens))
    except (TypeError, ValueError):
        return None


def _generation_result(
    record: Record, gen: Generation, usage: Usage, sid: str, attempt_id: str
) -> ResultRecord:
    if gen.error is None and gen.output is not None:
        return ResultRecord.succeeded(
            line=record.line,
            id=record.id,
            output=gen.output,
            usage=usage,
            shard_id=sid,
            attempt_id=attempt_id,
            finish_reason=gen.finish_reason,
            choices=gen.choices,
        )
    code, message = (gen.error.code, gen.error.message) if gen.error else (ENGINE_ERROR, "no output")
    return ResultRecord.failed(
        line=record.line,
        id=record.id,
        code=code,
        message=message,
        usage=usage,
        shard_id=sid,
        attempt_id=attempt_id,
    )


def _unrecordable(result: ResultRecord) -> str | None:
    """Why ``result`` does not read back from its JSON line as itself (None: it does)."""
    try:
        line = result.to_json_bytes()
    except (TypeError, ValueError) as exc:  # orjson: surrogates, integers beyond 64 bits
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    try:
        same = ResultRecord.parse_line(line) == result
    except ValueError as exc:
        return _why_invalid(exc)
    return None if same else "it does not read back as written"


def _why_invalid(exc: Exception) -> str:
    """One line saying why a result is invalid, without the values (record contents never travel)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        parts = [
            f"{'.'.join(str(p) for p in e['loc']) or 'result'}: {e['msg']}"
            for e in errors(include_url=False, include_input=False, include_context=False)
        ]
        return "; ".join(parts[:3])
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def generate_microbatch(
    engine: Engine, records: Sequence[Record], params: GenerationParams
) -> tuple[list[Generation | None], dict[int, str]]:
    """Run the engine on the records whose parameters are valid; keep the others as rejections."""
    rejected: dict[int, str] = {}
    runnable: list[int] = []
    for pos, record in enumerate(records):
        try:
            params.for_request(record.request)
        except (TypeError, ValueError) as exc:
            rejected[pos] = f"invalid generation parameters: {exc}"
        else:
            runnable.append(pos)
    generations: list[Generation | None] = [None] * len(records)
    if runnable:
        with _engine_must_return(engine, "a microbatch"):
            produced = engine.generate([records[i].request for i in runnable], params)
        if len(produced) != len(runnable):
            raise EngineError(
                f"engine {engine.name} returned {len(produced)} generations for {len(runnable)} "
                "requests; this is an engine bug"
            )
        for pos, gen in zip(runnable, produced, strict=True):
            # structured output is checked here, for every engine, before anything commits
            generations[pos] = check_structured(gen, params.for_request(records[pos].request))
    return generations, rejected


@contextlib.contextmanager
def _engine_must_return(engine: Engine, during: str) -> Iterator[None]:
    """An engine that ends the process (``sys.exit``, ``SystemExit`` from a library) fails the try.

    Otherwise the worker would exit with the engine's code, 0 included, which says "shard done"
    while the shard is still leased and unfinished, and no failure would be recorded.
    """
    try:
        yield
    except SystemExit as exc:
        raise EngineError(
            f"engine {engine.name} tried to end the process (exit code {exc.code!r}) during {during} "
            "instead of returning or raising an error; this is an engine bug"
        ) from None


# ------------------------------------------------------------------------------------- heartbeat


class Heartbeat:
    """Extends the lease every ``ttl / 3`` from a daemon thread, so long microbatches keep it.

    Before each beat it calls ``watchdog``, which ends the process when the engine made no
    progress for too long: a hung engine must not keep its lease alive forever through this
    thread, holding the shard from every other try until the deadline passes. Once the lease is
    lost the thread beats no more but keeps watching, so a hung engine whose lease was fenced
    (its job cancelled) still ends, instead of leaving its launcher waiting on it for ever.
    """

    def __init__(
        self, store: ManifestStore, lease: Lease, ttl_s: float, watchdog: Callable[[], None] | None = None
    ) -> None:
        self._store = store
        self._lease = lease
        self._ttl_s = ttl_s
        self._watchdog = watchdog
        self._stop = threading.Event()
        self.lost = threading.Event()
        self.lost_reason = ""
        self._thread = threading.Thread(target=self._run, name="adb-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._ttl_s)

    def _run(self) -> None:
        while not self._stop.wait(self._ttl_s / 3):
            if self._watchdog is not None:
                self._watchdog()
            if self.lost.is_set():
                if self._watchdog is None:
                    return
                continue
            try:
                self._lease = self._store.heartbeat(self._lease, self._ttl_s)
            except LeaseLost as exc:
                self.lost_reason = str(exc)
                self.lost.set()
                log.warning("heartbeat: lease lost: %s", exc)
            except Exception as exc:  # a store blip: the next beat (or the commit) decides
                log.warning("heartbeat failed (will retry): %s", exc)


# ------------------------------------------------------------------------------------- the worker


class ShardWorker:
    """One attempt at one shard; :meth:`run` returns the process exit code."""

    def __init__(
        self, config: WorkerConfig, *, store_factory: Callable[[str], ManifestStore] = ManifestStore
    ) -> None:
        self.config = config
        self._store_factory = store_factory
        self.lease: Lease | None = None
        self._store: ManifestStore | None = None
        self._ttl_s = 0.0
        self.heartbeat: Heartbeat | None = None
        self.phase = Phase.STARTING
        self._critical = 0
        self._pending: str | None = None
        self._shutting_down = False
        self._stop_requested_at: float | None = None
        self._grace_deadline: float | None = None
        self._generate_started: float | None = None
        self._generate_records = 0
        self._measured: list[tuple[int, float]] = []  # (records, seconds) of finished microbatches
        self._committed = 0  # microbatches this try committed (a try with progress spends no budget)
        # the engine call watched for a hang: what it is, the seconds it ran so far, when they
        # were last counted, and how long it may run
        self._watch_lock = threading.Lock()
        self._watched: tuple[str, float, float, float] | None = None
        self._est_s_per_record: float | None = None  # the planner's estimate for this shard

    # -- signals ----------------------------------------------------------------------------------

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested_at is not None

    def _install_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous: dict[int, Any] = {}
        for signum, handler in (
            (signal.SIGTERM, self._on_sigterm),
            (signal.SIGINT, self._on_sigint),
            (signal.SIGALRM, self._on_alarm),
        ):
            previous[signum] = signal.signal(signum, handler)
        return previous

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self._shutting_down:
            return
        now = time.monotonic()
        if self._stop_requested_at is not None:
            log.warning("second SIGTERM: stopping now")
            self._interrupt("second termination signal")
            return
        self._stop_requested_at = now
        self._grace_deadline = now + self.config.grace_s
        log.warning("SIGTERM (preemption notice): no new microbatch; grace %.1fs", self.config.grace_s)
        if self.phase in (Phase.STARTING, Phase.LOADING):
            self._interrupt("preempted before the first microbatch")
        elif self.phase is Phase.GENERATING:
            self._decide_current_microbatch(now)

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if not self._shutting_down:
            log.warning("SIGINT: stopping now")
            self._interrupt("interrupted")

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        if not self._shutting_down and self.phase is Phase.GENERATING:
            log.warning("grace period running out: abandoning the current microbatch")
            self._interrupt("preempted: grace period ran out during a microbatch")

    def _safety_margin(self) -> float:
        """Time kept after abandoning a microbatch to release the lease before the hard kill."""
        return min(5.0, 0.2 * self.config.grace_s)

    def _expected_seconds(self, records: int) -> float | None:
        done = sum(n for n, _ in self._measured)
        if not done:
            return None
        return sum(s for _, s in self._measured) / done * records

    def _decide_current_microbatch(self, now: float) -> None:
        """Keep the running microbatch only if its measured pace says it ends within the grace."""
        assert self._grace_deadline is not None and self._generate_started is not None
        usable_until = self._grace_deadline - self._safety_margin()
        expected = self._expected_seconds(self._generate_records)
        if expected is not None and self._generate_started + expected > usable_until:
            log.warning(
                "current microbatch needs ~%.1fs more than the grace allows: abandoning it",
                self._generate_started + expected - usable_until,
            )
            self._interrupt("preempted: the current microbatch would not fit in the grace period")
            return
        if hasattr(signal, "setitimer"):  # abandon it anyway if it is still running at the deadline
            signal.setitimer(signal.ITIMER_REAL, max(0.001, usable_until - now))

    def _interrupt(self, reason: str) -> None:
        """Raise into the main thread now, or as soon as the current store operation is over."""
        if self._critical:
            self._pending = self._pending or reason
            return
        raise _Interrupted(reason)

    @contextlib.contextmanager
    def _store_call(self) -> Iterator[None]:
        """A store transaction is never cut by a signal; a pending interrupt is raised after it."""
        self._critical += 1
        try:
            yield
        finally:
            self._critical -= 1
        if self._pending and not self._critical and not self._shutting_down:
            reason, self._pending = self._pending, None
            raise _Interrupted(reason)

    # -- run --------------------------------------------------------------------------------------

    def run(self) -> int:
        previous = self._install_signals()
        try:
            return self._run()
        except _Interrupted as exc:  # a signal landed between two handled steps
            return self._finish(self._store, FailureClass.PREEMPTED, AttemptOutcome.PREEMPTED, exc.reason)
        finally:
            self._shutting_down = True
            if previous:
                signal.setitimer(signal.ITIMER_REAL, 0)
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
            if self.heartbeat is not None:
                self.heartbeat.stop()

    def _run(self) -> int:
        cfg = self.config
        try:
            store = self._store = self._store_factory(cfg.store_url)
            with self._store_call():
                job = store.get_job(cfg.job_id)
                ttl_s = cfg.lease_ttl_s or job.lease_ttl_s
                if not 0 < ttl_s <= MAX_SECONDS:
                    raise ConfigurationError(
                        f"job {job.job_id} has lease_ttl_s {ttl_s}, not a number of seconds > 0 and "
                        f"<= {MAX_SECONDS:g}; pass --lease-ttl or re-plan the job with a valid lease TTL"
                    )
                claim = store.claim_race if cfg.race else store.claim_shard
                self.lease = claim(
                    cfg.job_id, cfg.shard_index, ttl_s=ttl_s, worker=cfg.worker_name, pool=cfg.pool
                )
        except ShardNotClaimable as exc:
            return self._not_claimable(exc)
        except _Interrupted as exc:
            return self._finish(self._store, FailureClass.PREEMPTED, AttemptOutcome.PREEMPTED, exc.reason)
        except Exception as exc:
            # nothing was claimed, so nothing is recorded in the store: the termination message
            # is the only place the class travels (a store it cannot reach, bad credentials)
            failure = classify_exception(exc)
            code = exit_code_for(failure)
            log.error("cannot claim (%s): %s", failure.value, _one_line(exc))
            write_termination_message(TryFailure(failure, _one_line(exc), claimed=False))
            return code
        lease = self.lease
        _set_log_prefix(cfg.job_id, cfg.shard_index, lease.attempt_id)
        log.info(
            "claimed%s: epoch %d, resuming at microbatch %d of %d, lease ttl %.1fs",
            " a racing lease" if cfg.race else "",
            lease.epoch,
            lease.cursor,
            lease.num_microbatches,
            ttl_s,
        )
        self._ttl_s = ttl_s
        self.heartbeat = Heartbeat(store, lease, ttl_s, self._watchdog)
        self.heartbeat.start()
        try:
            completed = self._process(store, job, lease)
        except _Interrupted as exc:
            return self._finish(store, FailureClass.PREEMPTED, AttemptOutcome.PREEMPTED, exc.reason)
        except LeaseLost as exc:
            if self._race_is_over(store, exc):
                return self._stop_racing(str(exc))
            # alive, so a stall past the TTL, not a preemption: the store learns it as ``stalled``
            # (over ``lost_lease`` if another claim already ended the attempt); still retryable
            return self._finish(store, FailureClass.PREEMPTED, AttemptOutcome.STALLED, str(exc))
        except Exception as exc:
            failure = classify_exception(exc)
            if failure is FailureClass.DETERMINISTIC:
                log.exception("try failed (deterministic)")
            return self._finish(store, failure, None, _one_line(exc))
        if not completed:
            return self._finish(
                store,
                FailureClass.PREEMPTED,
                AttemptOutcome.PREEMPTED,
                "preempted: stopped after the last committed microbatch",
            )
        log.info("shard complete")
        return EXIT_DONE

    def _race_is_over(self, store: ManifestStore, exc: LeaseLost) -> bool:
        """Whether the lease went to the other attempt of a race (the store ended this one ``lost_race``)."""
        if exc.fields.get("lost_race"):
            return True
        if self.lease is None:
            return False
        try:
            with self._store_call():
                tries = store.list_attempts(self.config.job_id)
        except Exception:  # cannot tell: end the try as a lost lease, the retry finds out
            return False
        mine = [a for a in tries if a.attempt_id == self.lease.attempt_id]
        return bool(mine) and mine[0].outcome is AttemptOutcome.LOST_RACE

    def _stop_racing(self, reason: str) -> int:
        """The race's other attempt has the shard: stop, no failure, no retry (the store ended this try)."""
        self._shutting_down = True
        self._disarm_alarm()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        log.info("the other attempt of the race has the shard; stopping: %s", reason)
        log.info("exit %d", EXIT_DONE)
        return EXIT_DONE

    def _not_claimable(self, exc: ShardNotClaimable) -> int:
        reason = str(getattr(exc, "reason", "unknown"))
        if reason == "succeeded":
            log.info("shard already committed: nothing to do")
            return EXIT_DONE
        if self.config.race and reason in ("not_running", "racing", "committed"):
            log.info("nothing to race (%s): %s", reason, exc)
            return EXIT_DONE
        if reason == "leased":
            log.warning("shard is leased by another live attempt: %s", exc)
            write_termination_message(
                TryFailure(FailureClass.PREEMPTED, str(exc), claimed=False, refused="leased")
            )
            return EXIT_RETRYABLE
        log.error("shard cannot be claimed (%s): %s", reason, exc)
        write_termination_message(
            TryFailure(FailureClass.DETERMINISTIC, str(exc), claimed=False, refused=reason)
        )
        return EXIT_TERMINAL

    def _finish(
        self,
        store: ManifestStore | None,
        failure: FailureClass,
        outcome: AttemptOutcome | None,
        reason: str,
    ) -> int:
        """End the try as ``failure`` (docs/design.md §6.6) and return its exit code.

        The attempt is recorded with its class (the store decides whether it spent the budget
        and whether the shard failed for good); signals are ignored from now on.
        """
        self._shutting_down = True
        if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
            signal.setitimer(signal.ITIMER_REAL, 0)
        if self.heartbeat is not None:
            self.heartbeat.stop()
        shard_failed = False
        if store is not None and self.lease is not None:
            try:
                after = store.fail_attempt(self.lease, failure, reason[:2000], outcome=outcome)
            except Exception as exc:  # the lease expires by itself; the launcher may also abandon it
                log.warning("release failed (the lease will expire): %s", _one_line(exc))
            else:
                if after is None:
                    log.warning("release: this attempt no longer held the lease")
                shard_failed = after is ShardState.TERMINAL_FAILURE
        code = exit_code_for(failure, shard_failed=shard_failed)
        level = logging.ERROR if code == EXIT_TERMINAL else logging.WARNING
        log.log(level, "%s (%s): %s", (outcome.value if outcome else "failed"), failure.value, reason)
        write_termination_message(
            TryFailure(
                failure,
                reason,
                claimed=self.lease is not None,
                progressed=self._committed > 0,
                shard_failed=shard_failed,
            )
        )
        log.info("exit %d", code)
        return code

    def _process(self, store: ManifestStore, job: JobRow, lease: Lease) -> bool:
        """Run the shard from the lease's cursor; True when complete, False when stopped early."""
        cfg = self.config
        jc = job.config
        try:
            params = GenerationParams.from_mapping(jc.get("generation") or {})
            size = int(jc.get("microbatch_size") or 0)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"job {job.job_id} has an invalid generation config: {exc}") from exc
        if size < 1:
            raise ConfigurationError(f"job {job.job_id} has microbatch_size {size}; it must be >= 1")
        engine = self._build_engine(jc, params)
        pin = jc.get("model_digest")
        digest = engine.model_digest
        if pin and pin != digest:
            raise ConfigurationError(
                f"model digest mismatch: job {job.job_id} pins {pin}, engine {engine.name} has {digest}; "
                "deploy the pinned weights or re-plan the job with this model"
            )

        with self._store_call():
            shard = store.get_shard(job.job_id, cfg.shard_index)
        shard_input = self._read_input(job, shard, size)
        if shard.est_work_s > 0 and shard.records > 0:
            self._est_s_per_record = shard.est_work_s / shard.records
        expected_mbs = microbatch_count(len(shard_input.records), size)
        if expected_mbs != lease.num_microbatches:
            raise ConfigurationError(
                f"shard {shard.shard_id} plans {lease.num_microbatches} microbatches but "
                f"{len(shard_input.records)} records in {size}s make {expected_mbs}; re-plan"
            )

        self.phase = Phase.LOADING
        started = time.monotonic()
        with _engine_must_return(engine, "its load"), self._watching("its load", cfg.stall_timeout_s):
            engine.load()
        log.info(
            "engine %s loaded (model %s) in %.1fs", engine.name, engine.model_name, time.monotonic() - started
        )

        output = open_storage(job.output_uri)
        seq = lease.cursor
        while seq < lease.num_microbatches:
            if self.stop_requested:
                return False
            self._check_heartbeat()
            seq = self._run_microbatch(
                store, output, engine, digest, lease, seq, shard_input.microbatch(seq), params
            )

        self.phase = Phase.FINISHING
        self._check_heartbeat()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        with self._store_call():
            store.complete_shard(lease)
        return True

    def _build_engine(self, jc: Mapping[str, Any], params: GenerationParams) -> Engine:
        options: dict[str, Any] = {"seed": params.seed, **self.config.engine_options}
        try:
            return get_engine(str(jc.get("engine") or "echo"), jc.get("model"), **options)
        except EngineError as exc:  # a wrong model path or missing option: retrying cannot fix it
            raise ConfigurationError(str(exc)) from exc
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"invalid engine option: {exc}; check --engine-option values") from exc

    def _read_input(self, job: JobRow, shard: ShardRow, size: int) -> ShardInput:
        storage, key = open_uri(job.input_uri)
        try:
            data = storage.read_range(key, shard.byte_start, shard.byte_end)
        except ObjectNotFound as exc:
            # the input changed after planning (docs/design.md §4.1): no try can read it again,
            # so the job stops with the cause instead of each shard spending its budget on it
            raise ConfigurationError(
                f"the input {job.input_uri} no longer exists; it was planned with SHA-256 "
                f"{job.input_sha256}: restore it, or re-plan the job",
                uri=job.input_uri,
            ) from exc
        actual = sha256_hex(data)
        if actual != shard.input_sha256:
            raise ChecksumMismatch(
                f"input bytes {shard.byte_start}-{shard.byte_end} of {job.input_uri} have SHA-256 {actual}, "
                f"planned {shard.input_sha256}; the input changed after planning: re-plan the job",
                uri=job.input_uri,
            )
        records = parse_shard(data, shard, limits_from_config(job.config))
        log.info("input range verified: %d records, %d bytes", len(records), len(data))
        return ShardInput(order_for_microbatches(records), size)

    def _check_heartbeat(self) -> None:
        if self.heartbeat is not None and self.heartbeat.lost.is_set():
            raise LeaseLost(self.heartbeat.lost_reason or "the heartbeat lost the lease")

    def _run_microbatch(
        self,
        store: ManifestStore,
        output: Any,
        engine: Engine,
        digest: str,
        lease: Lease,
        seq: int,
        records: Sequence[Record],
        params: GenerationParams,
    ) -> int:
        """Generate, write and commit microbatch ``seq``; the next microbatch to run."""
        self._generate_records = len(records)
        self._generate_started = started = time.monotonic()
        self.phase = Phase.GENERATING  # after the fields the SIGTERM handler reads
        if self._stop_requested_at is not None:
            # a notice that landed after the loop's check saw no GENERATING phase: decide now
            self._decide_current_microbatch(time.monotonic())
        with self._watching(f"microbatch {seq}", self._microbatch_limit(len(records))):
            generations, rejected = generate_microbatch(engine, records, params)
        gen_s = time.monotonic() - started
        self.phase = Phase.WRITING
        self._disarm_alarm()
        self._measured.append((len(records), gen_s))
        results = result_records(
            records, generations, rejected, shard_index=lease.shard_index, attempt_id=lease.attempt_id
        )
        data = encode_results(results)
        _fault_disk_full()
        uri = output.put_bytes(object_key(lease.attempt_id, lease.shard_index, seq), data)
        sha = sha256_hex(data)
        self._fault_pause_after_write(seq)
        _fault_kill_after_write(seq)
        self._check_heartbeat()  # a lost lease: do not even try to commit
        succeeded = sum(1 for r in results if r.status == "succeeded")
        counts = {"succeeded": succeeded, "errored": len(results) - succeeded}
        self.phase = Phase.COMMITTING
        try:
            with self._store_call():
                store.commit_microbatch(
                    lease,
                    seq=seq,
                    uri=uri,
                    sha256=sha,
                    records=len(results),
                    counts=counts,
                    prompt_tokens=sum(r.usage.prompt_tokens for r in results),
                    completion_tokens=sum(r.usage.completion_tokens for r in results),
                    elapsed_s=time.monotonic() - started,
                    model_digest=digest,
                    pool=self.config.pool,
                )
        except LeaseLost:
            raise
        except StoreError as exc:
            ahead = exc.fields.get("expected_seq")
            if not isinstance(ahead, int) or ahead <= seq:
                raise
            # the other attempt of a race committed this one and then ended: go on from the cursor
            log.info("microbatch %d was committed by the other attempt of a race; resuming at %d", seq, ahead)
            return ahead
        self._committed += 1
        log.info(
            "committed microbatch %d/%d: %d records (%d errored) in %.2fs",
            seq + 1,
            lease.num_microbatches,
            len(results),
            counts["errored"],
            time.monotonic() - started,
        )
        return seq + 1

    def _microbatch_limit(self, records: int) -> float:
        """How long one microbatch's engine call may run before it counts as a hang."""
        if self.config.stall_timeout_s is not None:
            return self.config.stall_timeout_s
        expected = self._expected_seconds(records)
        if expected is None and self._est_s_per_record is not None:
            expected = self._est_s_per_record * records
        return max(STALL_FLOOR_S, STALL_FACTOR * (expected or 0.0))

    @contextlib.contextmanager
    def _watching(self, what: str, limit_s: float | None) -> Iterator[None]:
        """Watch an engine call for a hang (``limit_s`` None: not watched)."""
        if limit_s is None:
            yield
            return
        with self._watch_lock:
            self._watched = (what, 0.0, time.monotonic(), limit_s)
        try:
            yield
        finally:
            # blocks for good if the watchdog is ending the process: nothing after it may commit
            with self._watch_lock:
                self._watched = None

    def _watchdog(self) -> None:
        """From the heartbeat thread: end the try when the watched engine call outran its limit.

        The main thread is inside the engine, where neither a signal nor an exception may reach it
        (a C extension, a lock), so this thread ends the attempt in the store (deterministic: a
        poison record hangs every try alike, so the budget stops it) and ends the process.

        A gap between two checks much longer than a beat is time the process did not run (SIGSTOP,
        a starved node), not the engine's: it counts as one beat, so a worker stopped past its
        lease ends ``stalled`` by the heartbeat that follows, as before, not as a hang.
        """
        with self._watch_lock:
            if self._watched is None:
                return
            what, ran_s, counted_at, limit_s = self._watched
            now, beat = time.monotonic(), self._ttl_s / 3
            ran_s += now - counted_at if now - counted_at <= 2 * beat else beat
            self._watched = (what, ran_s, now, limit_s)
            if ran_s <= limit_s:
                return
            reason = (
                f"the engine made no progress for {ran_s:.0f}s during {what} (limit {limit_s:g}s): "
                "it hangs; raise --stall-timeout if it is only slow"
            )
            self._shutting_down = True  # a signal now changes nothing: the process is ending
            code = self._finish(self._store, FailureClass.DETERMINISTIC, None, reason)
            for handler in log.handlers:
                handler.flush()
            os._exit(code)

    def _disarm_alarm(self) -> None:
        if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
            signal.setitimer(signal.ITIMER_REAL, 0)

    def _fault_pause_after_write(self, seq: int) -> None:
        path = os.environ.get(ENV_PAUSE_AFTER_WRITE)
        if not path or seq != int(os.environ.get(ENV_PAUSE_SEQ) or 0):
            return
        if self.heartbeat is not None:
            self.heartbeat.stop()
        tmp = Path(f"{path}.tmp")
        tmp.write_text(f"{os.getpid()} {seq}\n")
        tmp.replace(path)
        log.warning("fault injection: paused after writing microbatch %d, before committing it", seq)
        resume = Path(f"{path}.resume")
        waiter = threading.Event()
        while not resume.exists():
            waiter.wait(0.05)
        log.warning("fault injection: resumed")
        if self._store is not None and self.lease is not None:
            self.heartbeat = Heartbeat(self._store, self.lease, self._ttl_s, self._watchdog)
            self.heartbeat.start()


def _fault_kill_after_write(seq: int) -> None:
    """Chaos hook: SIGKILL this process between writing an object and committing it.

    With ``ADB_FAULT_KILL_AFTER_WRITE_PROB=p`` the worker kills itself with probability ``p`` at
    this exact instant (a real SIGKILL: no handler, no cleanup), so chaos tests hit the window
    that a random external kill rarely lands in.
    """
    raw = os.environ.get(ENV_KILL_AFTER_WRITE)
    if not raw:
        return
    import random

    if random.random() < float(raw):
        log.warning("fault injection: SIGKILL after writing microbatch %d, before committing it", seq)
        os.kill(os.getpid(), signal.SIGKILL)


def _fault_disk_full() -> None:
    """Chaos hook: while ``$ADB_FAULT_DISK_FULL`` exists, an object write fails with ``ENOSPC``."""
    path = os.environ.get(ENV_DISK_FULL)
    if not path or not os.path.exists(path):
        return
    with contextlib.suppress(OSError):
        Path(f"{path}.hit").touch()
    error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    raise StorageError(f"cannot write the microbatch object: {error}") from error


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


def termination_log_path() -> str | None:
    """Where the termination message goes: ``$ADB_TERMINATION_LOG``, else Kubernetes' path if present."""
    path = os.environ.get(ENV_TERMINATION_LOG)
    if path:
        return path
    return K8S_TERMINATION_LOG if os.path.exists(K8S_TERMINATION_LOG) else None


def write_termination_message(failure: TryFailure) -> None:
    """Say how this try failed, as one JSON line (never record contents; at most 4 KiB, as Kubernetes)."""
    path = termination_log_path()
    if not path:
        return
    data = orjson.dumps(failure.to_dict())[:4000]
    with contextlib.suppress(OSError):
        Path(path).write_bytes(data + b"\n")


# ------------------------------------------------------------------------------------- logging


class _PrefixFilter(logging.Filter):
    prefix = ""

    def filter(self, record: logging.LogRecord) -> bool:
        record.adb_prefix = self.prefix
        return True


_PREFIX = _PrefixFilter()


def _set_log_prefix(job_id: str, shard_index: int, attempt_id: str | None) -> None:
    _PREFIX.prefix = f"job={job_id} shard={display_shard_id(shard_index)} attempt={attempt_id or '-'}"


def configure_logging(job_id: str, shard_index: int, level: int = logging.INFO) -> None:
    """One line per event on stderr, prefixed by job/shard/attempt (never record contents)."""
    handler = logging.StreamHandler()
    handler.addFilter(_PREFIX)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s worker %(adb_prefix)s %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False
    _set_log_prefix(job_id, shard_index, None)


def run_worker(config: WorkerConfig) -> int:
    """Run one attempt at one shard; the process exit code (0 / 75 / 1)."""
    return ShardWorker(config).run()
