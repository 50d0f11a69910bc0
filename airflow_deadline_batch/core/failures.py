"""Every failed try is classified once, here (docs/design.md §6.6 and §10).

Four classes, and what each means for the shard:

* ``preempted``: the node went away or the lease did (SIGTERM notice, eviction, a kill the launcher
  sent, a lost lease). Retried at once, on the pool the slack allows; never spends the budget.
* ``transient``: infrastructure that will come back (the store or the object store unreachable,
  throttled or restarting, a reset connection, a time-out, a full disk). Retried after an
  exponential, jittered, capped backoff for as long as the deadline's slack allows; never spends
  the budget.
* ``deterministic``: anything else (an engine bug, a poison record, a worker that crashed by
  itself). Spends one unit of ``max_attempts``, but only when the try committed nothing: a try
  that made progress is not the same failure again.
* ``configuration``: no retry can help and no shard can succeed (credentials, a missing bucket or
  model, bad options, a model digest mismatch, an input that changed since planning). The job is
  stopped at once with the cause.

Pure: the classification reads exception types by name, ``errno``, SQLSTATEs and the error
codes botocore puts in ``response``, walking the ``__cause__`` / ``__context__`` chain, so this
module imports no driver.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import math
import random
import signal
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from airflow_deadline_batch.core.exit_codes import EXIT_OK, EXIT_RETRYABLE, EXIT_TERMINAL
from airflow_deadline_batch.exceptions import ConfigurationError

__all__ = [
    "BACKOFF_BASE_S",
    "BACKOFF_CAP_S",
    "LATENCY_OPTION",
    "LATE_SAMPLES",
    "MAX_LATE_S",
    "MAX_RESUME_DELAY_S",
    "MIN_RESUME_DELAY_S",
    "RESUME_DELAY_OPTION",
    "SCHEDULER_LATENCY_S",
    "FailureClass",
    "TryFailure",
    "TryLedger",
    "backoff_s",
    "classify_exception",
    "classify_exit",
    "exit_code_for",
    "finite_seconds",
    "parse_resume_delay",
    "parse_scheduler_latency",
    "parse_seconds_option",
    "retry_delay_bound_s",
    "spends_budget",
]


class FailureClass(str, enum.Enum):
    """The four classes of a failed try (docs/design.md §6.6)."""

    PREEMPTED = "preempted"
    TRANSIENT = "transient"
    DETERMINISTIC = "deterministic"
    CONFIGURATION = "configuration"


#: first backoff bound and cap of the relaunch backoff after a transient failure (seconds)
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 30.0
#: The least delay between a try handing its slot back (a reschedule, a deferral) and the task's
#: next start, by default. Airflow 3.3's scheduler fails a task that starts again before it has
#: processed the executor's report of the previous exit (docs/airflow.md, *Resuming tasks*); a
#: scheduler loop takes about a second, several on a loaded machine. :data:`RESUME_DELAY_OPTION`
#: overrides it.
MIN_RESUME_DELAY_S = 5.0
#: the Airflow option that sets the resume delay (env ``AIRFLOW__DEADLINE_BATCH__MIN_RESUME_DELAY_S``)
RESUME_DELAY_OPTION = "[deadline_batch] min_resume_delay_s"
#: the longest resume delay the option takes (a day): every reschedule waits it, a last try waits it
#: in its slot, and far beyond it the reschedule's date overflows (``OverflowError``, not the option)
MAX_RESUME_DELAY_S = 86_400.0


#: The latency assumed, at least, between the time a try asks Airflow to start the task again (a
#: reschedule's date, a retry's) and the next try's placement decision: the scheduler's loop, the
#: executor starting the task (a pod, for the KubernetesExecutor), the DAG file's parse. The shard
#: operators learn more from what they see (``TryLedger.late_s``); :data:`LATENCY_OPTION` overrides it.
SCHEDULER_LATENCY_S = 60.0
#: the Airflow option that sets it (env ``AIRFLOW__DEADLINE_BATCH__SCHEDULER_LATENCY_S``)
LATENCY_OPTION = "[deadline_batch] scheduler_latency_s"


def parse_seconds_option(
    value: str | float | None, *, option: str, default: float, maximum: float = MAX_RESUME_DELAY_S
) -> float:
    """The seconds an Airflow option's value sets (unset or blank: ``default``).

    ``option`` is the option as ``[section] key``. A value that is not a number of seconds from 0
    to ``maximum`` raises ``ConfigurationError`` naming the option and its environment variable.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or not 0 <= seconds <= maximum:
        section, key = option.strip("[").split("] ")
        env = f"AIRFLOW__{section.upper()}__{key.upper()}"
        raise ConfigurationError(
            f"{option} must be a number of seconds >= 0 and <= {maximum:g}, got {value!r}: set it "
            f"(or {env}) to e.g. {default:g}, or unset it"
        )
    return seconds


def parse_resume_delay(value: str | float | None) -> float:
    """The resume delay an option's value sets, in seconds (unset or blank: :data:`MIN_RESUME_DELAY_S`)."""
    return parse_seconds_option(value, option=RESUME_DELAY_OPTION, default=MIN_RESUME_DELAY_S)


def parse_scheduler_latency(value: str | float | None) -> float:
    """The scheduler latency an option's value sets, in seconds (unset or blank:
    :data:`SCHEDULER_LATENCY_S`)."""
    return parse_seconds_option(value, option=LATENCY_OPTION, default=SCHEDULER_LATENCY_S)


#: our own exception classes (by name: core imports no exception module it does not need)
_CONFIGURATION_TYPES = frozenset(
    {
        "ConfigurationError",
        "InputError",
        "ChecksumMismatch",
        "JobNotFound",
        # botocore / boto3
        "NoCredentialsError",
        "PartialCredentialsError",
        "NoRegionError",
        "InvalidRegionError",
        "ParamValidationError",
        "UnknownServiceError",
        # a model or an engine extra that is not installed
        "ModuleNotFoundError",
    }
)
_PREEMPTED_TYPES = frozenset({"LeaseLost"})
_TRANSIENT_TYPES = frozenset(
    {
        "ConnectionError",
        "ConnectionResetError",
        "ConnectionRefusedError",
        "ConnectionAbortedError",
        "BrokenPipeError",
        "TimeoutError",
        # botocore
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ProxyConnectionError",
        "ResponseStreamingError",
        "IncompleteReadError",
        # psycopg / SQLAlchemy
        "OperationalError",
        "InterfaceError",
        "DisconnectionError",
        "AdminShutdown",
        "CannotConnectNow",
        "SerializationFailure",
        "DeadlockDetected",
    }
)
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.EAGAIN,
        errno.EBUSY,
        errno.EIO,
    }
)
#: SQLSTATE classes: 08 connection exception, 40 transaction rollback, 53 insufficient resources,
#: 57P operator intervention (admin shutdown, cannot connect now), 58 system error
_TRANSIENT_SQLSTATE_PREFIXES = ("08", "40", "53", "57P", "58")
#: SQLSTATE classes: 28 invalid authorization, 3D invalid catalog (no such database)
_CONFIGURATION_SQLSTATE_PREFIXES = ("28", "3D")
#: error codes of S3 (``response["Error"]["Code"]``)
_CONFIGURATION_S3_CODES = frozenset(
    {
        "NoSuchBucket",
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidBucketName",
        "AuthorizationHeaderMalformed",
        "ExpiredToken",
        "InvalidToken",
        "403",
    }
)
_TRANSIENT_S3_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "SlowDown",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "RequestLimitExceeded",
        "500",
        "502",
        "503",
        "504",
    }
)
_CONFIGURATION_MESSAGES = (
    "password authentication failed",
    "no password supplied",
    "authentication failed",
    "model digest mismatch",
    "no such bucket",
    "access denied",
    "invalid engine option",
    "no manifest store",
)
_TRANSIENT_MESSAGES = (
    "connection refused",
    "connection reset",
    "could not connect",
    "server closed the connection",
    "connection timeout",
    "timed out",
    "terminating connection",
    "database system is shutting down",
    "database system is starting up",
    "the database system is in recovery",
    "database is shutting down",
    "database is locked",
    "no space left on device",
    "disk full",
    "database or disk is full",
    "throttl",
    "slow down",
    "service unavailable",
    "could not connect to the endpoint",
    "connection was closed",
    "broken pipe",
    "temporarily unavailable",
)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__
        if len(seen) > 20:
            return


def _s3_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    error = response.get("Error")
    code = error.get("Code") if isinstance(error, dict) else None
    if code is None:
        meta = response.get("ResponseMetadata")
        status = meta.get("HTTPStatusCode") if isinstance(meta, dict) else None
        return str(status) if status is not None else None
    return str(code)


def _classify_one(exc: BaseException) -> FailureClass | None:
    """The class one exception in a chain says by itself, or None when it says nothing."""
    name = type(exc).__name__
    fields = getattr(exc, "fields", None)
    if isinstance(fields, dict) and isinstance(fields.get("failure"), str):
        try:
            return FailureClass(fields["failure"])
        except ValueError:
            pass
    if name in _PREEMPTED_TYPES:
        return FailureClass.PREEMPTED
    if name in _CONFIGURATION_TYPES:
        return FailureClass.CONFIGURATION
    code = _s3_code(exc)
    if code is not None:
        if code in _CONFIGURATION_S3_CODES:
            return FailureClass.CONFIGURATION
        if code in _TRANSIENT_S3_CODES or code.startswith("5"):
            return FailureClass.TRANSIENT
    sqlstate = getattr(exc, "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate:
        if sqlstate.startswith(_CONFIGURATION_SQLSTATE_PREFIXES):
            return FailureClass.CONFIGURATION
        if sqlstate.startswith(_TRANSIENT_SQLSTATE_PREFIXES):
            return FailureClass.TRANSIENT
    number = getattr(exc, "errno", None)
    if isinstance(number, int) and number in _TRANSIENT_ERRNOS:
        return FailureClass.TRANSIENT
    text = str(exc).lower()
    transient_text = any(m in text for m in _TRANSIENT_MESSAGES)
    no_such = "does not exist" in text and ('database "' in text or 'role "' in text)
    if (no_such or any(m in text for m in _CONFIGURATION_MESSAGES)) and not transient_text:
        return FailureClass.CONFIGURATION
    if transient_text:
        return FailureClass.TRANSIENT
    if name in _TRANSIENT_TYPES:
        return FailureClass.TRANSIENT
    return None


def classify_exception(exc: BaseException) -> FailureClass:
    """The class of the failure ``exc`` ended a try with (deterministic when nothing says otherwise).

    The outermost exception that says something wins: our own errors carry their class (an error
    whose ``fields`` has ``failure``), then types, S3 codes, SQLSTATEs, ``errno`` and messages of
    each exception along the cause chain.
    """
    for link in _chain(exc):
        found = _classify_one(link)
        if found is not None:
            return found
    return FailureClass.DETERMINISTIC


def spends_budget(failure: FailureClass | str, *, progressed: bool) -> bool:
    """Whether a failed try spends one unit of ``max_attempts``: deterministic and no commit."""
    return FailureClass(failure) is FailureClass.DETERMINISTIC and not progressed


def exit_code_for(failure: FailureClass | str, *, shard_failed: bool = False) -> int:
    """The worker's exit code for a failed try: 1 when no retry can help, 75 otherwise (§6.5)."""
    if FailureClass(failure) is FailureClass.CONFIGURATION or shard_failed:
        return EXIT_TERMINAL
    return EXIT_RETRYABLE


def classify_exit(returncode: int, *, signalled_by_launcher: bool) -> FailureClass | None:
    """The class of a worker exit when the worker could not say it (None: it succeeded).

    Exit 75 is retryable (transient unless the worker said otherwise), 1 terminal (configuration),
    a kill the launcher sent (a preemption it injected, a drain) preempted, any other death by a
    signal (a crash, the OOM killer) deterministic.
    """
    if returncode == EXIT_OK:
        return None
    killed = returncode < 0 or returncode in (128 + signal.SIGKILL, 128 + signal.SIGTERM)
    if killed:
        return FailureClass.PREEMPTED if signalled_by_launcher else FailureClass.DETERMINISTIC
    if returncode == EXIT_RETRYABLE:
        return FailureClass.TRANSIENT
    if returncode == EXIT_TERMINAL:
        return FailureClass.CONFIGURATION
    return FailureClass.DETERMINISTIC


def backoff_s(
    failures_in_a_row: int,
    *,
    base_s: float = BACKOFF_BASE_S,
    cap_s: float = BACKOFF_CAP_S,
    slack_s: float | None = None,
    rng: random.Random | None = None,
) -> float:
    """Wait before the next try after ``failures_in_a_row`` transient failures (full jitter).

    Uniform in ``[0, min(cap, base * 2**(n-1))]``, and never more than the slack the deadline
    leaves (none when the slack is gone: the deadline, not the backoff, ends the job).
    """
    if failures_in_a_row <= 0:
        return 0.0
    bound = min(cap_s, base_s * 2.0 ** min(failures_in_a_row - 1, 30))
    if slack_s is not None:
        bound = min(bound, max(0.0, slack_s))
    return (rng or random).uniform(0.0, bound) if bound > 0 else 0.0


@dataclass(frozen=True)
class TryFailure:
    """How one try failed, as the worker reports it (termination message) and the store records it."""

    failure: FailureClass
    error: str
    #: the try claimed the shard (False: it died before, so it recorded nothing in the store)
    claimed: bool = True
    #: the try committed at least one microbatch
    progressed: bool = False
    #: the store failed the shard for good after this try (its budget is spent)
    shard_failed: bool = False
    #: the claim was refused: ``leased`` (another live attempt), ``exhausted``, ``job_inactive``
    refused: str | None = None

    def to_dict(self) -> dict[str, object]:
        return {
            "failure": self.failure.value,
            "error": self.error,
            "claimed": self.claimed,
            "progressed": self.progressed,
            "shard_failed": self.shard_failed,
            "refused": self.refused,
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> TryFailure:
        refused = data.get("refused")
        return cls(
            failure=FailureClass(str(data["failure"])),
            error=str(data.get("error") or ""),
            claimed=bool(data.get("claimed", True)),
            progressed=bool(data.get("progressed", False)),
            shard_failed=bool(data.get("shard_failed", False)),
            refused=str(refused) if refused is not None else None,
        )


@dataclass(frozen=True)
class TryLedger:
    """What a shard task's operator did with each Airflow try of one task instance.

    Kept in Airflow's task state store (one task instance's keys, shared by its tries): the
    tries whose operator ran, the tries it ended itself (returned, skipped or failed them), the
    tries that handed their worker slot back at least once (a reschedule, a deferral), and the
    tries already found lost. A try before the current one that its operator did not end was ended
    by Airflow from outside: the resume race (docs/airflow.md, *Resuming tasks*) when it had
    handed its slot back, else a killed task process or a clear.

    It also times Airflow's turnaround: when a run hands its slot back or fails, the time it
    asked to run again (``due_at``, epoch seconds) and the task instance's ``max_tries`` then
    (``due_max_tries``: Airflow's clear changes it, nothing else does); when the next run starts,
    or a deferred run resumes, how late it came against that (``late``: the last
    :data:`LATE_SAMPLES`, oldest first). The placement allows for :attr:`late_s`, an estimate that
    one outlier (a paused DAG, a one-off stall) moves for the run that saw it only.
    """

    started: frozenset[int] = frozenset()
    ended: frozenset[int] = frozenset()
    handed_back: frozenset[int] = frozenset()
    lost: frozenset[int] = frozenset()
    due_at: float | None = None
    due_max_tries: int | None = None
    late: tuple[float, ...] = ()

    @property
    def late_s(self) -> float:
        """Airflow's lateness to allow for: the larger of the latest sample (a scheduler slow now
        is likely slow at the next start) and the second largest of :attr:`late` (an older slow
        start counts only while another of the last :data:`LATE_SAMPLES` was as slow). So one
        outlier counts until the next start, and a scheduler slow at two of the last
        :data:`LATE_SAMPLES` starts counts as long as both are in the window. 0 with no sample."""
        if not self.late:
            return 0.0
        second = sorted(self.late)[-2] if len(self.late) > 1 else 0.0
        return max(self.late[-1], second)

    def newly_lost(self, try_number: int) -> tuple[int, ...]:
        """The tries before ``try_number`` that nobody ended here and nobody found lost yet."""
        return tuple(k for k in range(1, try_number) if k not in self.ended and k not in self.lost)

    def resume_races(self, lost: Sequence[int]) -> tuple[int, ...]:
        """Of ``lost``, the tries that had handed their slot back: resumed, then ended by Airflow."""
        return tuple(k for k in lost if k in self.handed_back)

    def with_(self, **tries: Iterable[int]) -> TryLedger:
        """This ledger with ``tries`` added to the named sets (``started=[3]``, ``lost=[1, 2]``)."""
        return dataclasses.replace(
            self, **{name: getattr(self, name) | frozenset(numbers) for name, numbers in tries.items()}
        )

    def due(self, at: float | None, *, max_tries: int | None = None) -> TryLedger:
        """This ledger with the next run due at ``at`` (epoch seconds; None: not known), asked for
        while the task instance's ``max_tries`` was ``max_tries`` (None: not known)."""
        return dataclasses.replace(self, due_at=at, due_max_tries=max_tries if at is not None else None)

    def cleared_since_due(self, max_tries: int | None) -> bool:
        """Whether the task instance was cleared since its next run was asked for: its ``max_tries``
        (``max_tries`` now) changed. Airflow's clear sets it to the try number plus the task's
        retries, which is more than any earlier try's clear set; nothing else changes it."""
        return self.due_max_tries is not None and max_tries is not None and max_tries != self.due_max_tries

    def arrived(self, now: float, *, max_tries: int | None = None) -> TryLedger:
        """This ledger once a run started at ``now`` (epoch seconds) with the task instance's
        ``max_tries`` at ``max_tries``: its lateness against the time it was due is the newest
        sample (a run earlier than due counts as on time; at most :data:`MAX_LATE_S`: the two
        times may come from two machines' clocks). A start after a clear is no sample: the
        clear, not the scheduler, decided when it came (:meth:`cleared_since_due`)."""
        if self.due_at is None:
            return self
        if self.cleared_since_due(max_tries):
            return self.due(None)
        late = min(max(now - self.due_at, 0.0), MAX_LATE_S)
        return dataclasses.replace(self.due(None), late=(*self.late, late)[-LATE_SAMPLES:])

    def to_dict(self) -> dict[str, object]:
        """The task state store's value. ``late_s`` is the estimate (what an earlier version reads
        as its worst lateness so far); ``late`` and ``due_max_tries`` are written only when set,
        so a ledger that never learned anything is stored as an earlier version stored it."""
        out: dict[str, object] = {name: sorted(getattr(self, name)) for name in _LEDGER_SETS}
        out.update(due_at=self.due_at, late_s=self.late_s)
        if self.due_max_tries is not None:
            out["due_max_tries"] = self.due_max_tries
        if self.late:
            out["late"] = list(self.late)
        return out

    @classmethod
    def from_dict(cls, data: object) -> TryLedger:
        """The ledger a task state store value holds (anything else: an empty ledger). An earlier
        version's, without times: its sets; with ``late_s`` (its worst lateness) but no ``late``:
        that worst as the one sample."""
        if not isinstance(data, dict):
            return cls()
        sets = {}
        for name in _LEDGER_SETS:
            numbers = data.get(name)
            if isinstance(numbers, list):
                sets[name] = frozenset(int(n) for n in numbers if isinstance(n, int))
        samples = data.get("late")
        if isinstance(samples, list):
            found = (finite_seconds(n) for n in samples)
            late = tuple(min(MAX_LATE_S, max(0.0, n)) for n in found if n is not None)[-LATE_SAMPLES:]
        else:
            worst = min(MAX_LATE_S, max(0.0, finite_seconds(data.get("late_s")) or 0.0))
            late = (worst,) if worst > 0 else ()
        due = finite_seconds(data.get("due_at"))
        mark = data.get("due_max_tries")
        if not isinstance(mark, int) or isinstance(mark, bool) or due is None:
            mark = None
        return cls(**sets, due_at=due, due_max_tries=mark, late=late)


_LEDGER_SETS = ("started", "ended", "handed_back", "lost")
#: the most lateness a ledger learns from one start (an hour): the due time was taken on the clock of
#: the machine that ran the previous try (or of the triggerer that fired a deferred try's event),
#: the start on this one's, so a skewed clock could otherwise make every later Spot try of the task
#: look unsafe
MAX_LATE_S = 3600.0
#: the latenesses a ledger keeps (its window): :attr:`TryLedger.late_s` takes the second largest
#: of them (and the latest), so a lateness seen at two starts is remembered while both are among the
#: last this many, and one outlier not after the next start
LATE_SAMPLES = 8


def finite_seconds(value: object) -> float | None:
    """``value`` as a finite number of seconds, or None (a bool, an int too large for a float too)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        seconds = float(value)
    except OverflowError:
        return None
    return seconds if math.isfinite(seconds) else None


def retry_delay_bound_s(
    retry_delay_s: float,
    try_number: int,
    *,
    exponential_backoff: float = 0.0,
    max_retry_delay_s: float | None = None,
    max_task_retry_delay_s: float = 86_400.0,
) -> float:
    """The longest Airflow waits to start the retry after try ``try_number`` failed.

    Airflow's scheduler computes it (``TaskInstance.next_retry_datetime``, which a task's process
    cannot call): the retry delay, or with exponential backoff a deterministic draw between
    ``b = ceil(delay × multiplier^(try − 1))`` (at least 1) and ``2 b``, capped by
    ``[core] max_task_retry_delay`` and the task's ``max_retry_delay``. A retry policy's override
    (Airflow 3.3's ``RetryPolicy``) is not seen here.
    """
    delay = max(0.0, retry_delay_s)
    multiplier = exponential_backoff or 1.0
    if multiplier != 1.0 and multiplier > 0:
        try:
            base = max(1.0, float(math.ceil(delay * multiplier ** max(0, try_number - 1))))
        except OverflowError:
            base = max_task_retry_delay_s
        delay = min(2 * base - 1, max_task_retry_delay_s)
        if max_retry_delay_s:
            delay = min(delay, max_retry_delay_s)
    return delay
