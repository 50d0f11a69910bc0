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
    "MAX_RESUME_DELAY_S",
    "MIN_RESUME_DELAY_S",
    "RESUME_DELAY_OPTION",
    "FailureClass",
    "TryFailure",
    "TryLedger",
    "backoff_s",
    "classify_exception",
    "classify_exit",
    "exit_code_for",
    "parse_resume_delay",
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


def parse_resume_delay(value: str | float | None) -> float:
    """The resume delay an option's value sets, in seconds (unset or blank: :data:`MIN_RESUME_DELAY_S`).

    A value that is not a number of seconds from 0 to :data:`MAX_RESUME_DELAY_S` raises
    ``ConfigurationError`` naming the option to fix.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return MIN_RESUME_DELAY_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_RESUME_DELAY_S:
        raise ConfigurationError(
            f"{RESUME_DELAY_OPTION} must be a number of seconds >= 0 and <= {MAX_RESUME_DELAY_S:g}, "
            f"got {value!r}: set it (or "
            f"AIRFLOW__DEADLINE_BATCH__MIN_RESUME_DELAY_S) to e.g. {MIN_RESUME_DELAY_S:g}, or unset it"
        )
    return seconds


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
    """

    started: frozenset[int] = frozenset()
    ended: frozenset[int] = frozenset()
    handed_back: frozenset[int] = frozenset()
    lost: frozenset[int] = frozenset()

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

    def to_dict(self) -> dict[str, list[int]]:
        return {field.name: sorted(getattr(self, field.name)) for field in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: object) -> TryLedger:
        """The ledger a task state store value holds (anything else: an empty ledger)."""
        if not isinstance(data, dict):
            return cls()
        sets = {}
        for field in dataclasses.fields(cls):
            numbers = data.get(field.name)
            if isinstance(numbers, list):
                sets[field.name] = frozenset(int(n) for n in numbers if isinstance(n, int))
        return cls(**sets)
