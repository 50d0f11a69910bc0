"""Clocks are passed in, never read from a global, so deadline logic is testable without sleeping."""

from __future__ import annotations

import datetime as dt
from typing import Protocol

UTC = dt.timezone.utc
#: The longest duration in seconds a job or worker setting may take (a lease TTL, a shutdown grace,
#: a stall timeout): a day. NaN and infinity fail the same range checks: a NaN lease expired at
#: once, a huge one outlived a dead worker (and overflowed the heartbeat's wait), an infinite grace
#: made a SIGTERM crash the alarm (``setitimer``).
MAX_SECONDS = 86_400.0


def ensure_aware(value: dt.datetime, name: str = "datetime") -> dt.datetime:
    """Return ``value`` in UTC; reject naive datetimes, whose meaning depends on the machine."""
    if value.tzinfo is None or value.tzinfo.utcoffset(value) is None:
        raise ValueError(f"{name} must be timezone-aware (for example 2026-12-01T06:00:00Z), got {value!r}")
    return value.astimezone(UTC)


class Clock(Protocol):
    def now(self) -> dt.datetime:
        """Current time, timezone-aware, in UTC."""
        ...


class SystemClock:
    """The real wall clock."""

    def now(self) -> dt.datetime:
        return dt.datetime.now(UTC)


class ManualClock:
    """A clock that only moves when told to; for tests and the simulator."""

    def __init__(self, start: dt.datetime) -> None:
        self._now = ensure_aware(start, "start")

    def now(self) -> dt.datetime:
        return self._now

    def advance(self, seconds: float) -> dt.datetime:
        self._now += dt.timedelta(seconds=seconds)
        return self._now

    def set(self, value: dt.datetime) -> None:
        self._now = ensure_aware(value, "value")
