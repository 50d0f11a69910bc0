"""Every error this package raises on purpose derives from :class:`DeadlineBatchError`.

Each error carries the fields a user needs to act (job, shard, line) and a message that names
the fix. Airflow exceptions appear only in the Airflow glue, never here.
"""

from __future__ import annotations

from typing import Any

from airflow_deadline_batch.core.exit_codes import EXIT_INCOMPLETE, EXIT_REJECTED, EXIT_TERMINAL, EXIT_USAGE


class DeadlineBatchError(Exception):
    """An airflow-deadline-batch operation failed."""

    #: process exit code the CLI uses for this error (docs/design.md §8; values in core.exit_codes)
    exit_code: int = EXIT_TERMINAL

    def __init__(self, message: str | None = None, **fields: Any) -> None:
        self.message = message or (self.__doc__ or "").strip()
        self.fields = fields
        for name, value in fields.items():
            setattr(self, name, value)
        super().__init__(self.message)


class ConfigurationError(DeadlineBatchError):
    """The configuration is invalid; fix the named option and retry."""

    exit_code = EXIT_USAGE


class InputError(DeadlineBatchError):
    """The input cannot be read as JSON Lines; check the path and its encoding."""

    exit_code = EXIT_USAGE


class AdmissionRejected(DeadlineBatchError):
    """The job was rejected at admission; nothing ran."""

    exit_code = EXIT_REJECTED

    def __init__(self, message: str | None = None, *, report: Any = None, **fields: Any) -> None:
        super().__init__(message, report=report, **fields)


class StoreError(DeadlineBatchError):
    """The manifest store refused or failed an operation."""

    #: the CLI (docs/design.md §8): the store gone past its retry window leaves the job
    #: unfinished and resumable
    exit_code = EXIT_INCOMPLETE


class JobNotFound(StoreError):
    """No job with this ID exists in the manifest store; check the job ID and --store URL."""

    exit_code = EXIT_USAGE


class InvalidTransition(StoreError):
    """A job or shard state transition is not allowed from its current state."""


class ShardNotClaimable(StoreError):
    """The shard cannot be claimed now (see ``reason``)."""

    def __init__(self, message: str | None = None, *, reason: str = "unknown", **fields: Any) -> None:
        super().__init__(message, reason=reason, **fields)


class LeaseLost(StoreError):
    """This attempt no longer holds the shard's lease (expired or fenced by a newer epoch)."""


class StorageError(DeadlineBatchError):
    """An object-storage operation failed."""

    #: the CLI (docs/design.md §8): storage gone past its retries leaves the job resumable
    exit_code = EXIT_INCOMPLETE


class ObjectExists(StorageError):
    """The object already exists; a conditional create lost the race."""


class ObjectChanged(StorageError):
    """A conditional write lost the race: the object changed, appeared or went since it was read."""


class ObjectNotFound(StorageError):
    """The object does not exist; check the URI."""


class ChecksumMismatch(StorageError):
    """An object's SHA-256 does not match the one recorded at commit time."""


class EngineError(DeadlineBatchError):
    """The inference engine failed to load or generate."""

    #: the CLI refuses an engine that cannot load at admission: a configuration error
    exit_code = EXIT_USAGE


class VerificationError(DeadlineBatchError):
    """The job's committed outcomes are incomplete or corrupt; nothing was published."""

    exit_code = EXIT_INCOMPLETE
