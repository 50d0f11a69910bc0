"""Parsing deadlines given on a command line or in a DAG: ISO 8601 instants or ``+DURATION``."""

from __future__ import annotations

import datetime as dt
import re

from airflow_deadline_batch.core.clock import UTC, ensure_aware

_DURATION = re.compile(r"^\+((?:\d+(?:\.\d+)?[dhms])+)$")
_PART = re.compile(r"(\d+(?:\.\d+)?)([dhms])")
_UNIT_SECONDS = {"d": 86_400.0, "h": 3_600.0, "m": 60.0, "s": 1.0}


def parse_duration(text: str) -> dt.timedelta:
    """``+90m``, ``+1h30m``, ``+2d``, ``+45s`` → a positive timedelta."""
    match = _DURATION.match(text.strip().replace(" ", ""))
    if not match:
        raise ValueError(f"invalid duration {text!r}: use +DURATION such as +30m, +2h or +1h30m")
    seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in _PART.findall(match.group(1)))
    if seconds <= 0:
        raise ValueError(f"invalid duration {text!r}: use a +DURATION longer than zero, such as +30m")
    return dt.timedelta(seconds=seconds)


def parse_deadline(value: str | dt.datetime, now: dt.datetime) -> dt.datetime:
    """Parse ``value`` (aware ISO 8601 instant, ``Z`` allowed, or ``+DURATION`` from ``now``).

    Naive timestamps are refused: a deadline that means different instants on different
    machines is a bug waiting for a daylight-saving night.
    """
    if isinstance(value, dt.datetime):
        return ensure_aware(value, "deadline")
    text = value.strip()
    if text.startswith("+"):
        return ensure_aware(now, "now") + parse_duration(text)
    try:
        parsed = dt.datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"invalid deadline {value!r}: use an ISO 8601 instant with a time zone "
            "(2026-12-01T06:00:00Z) or +DURATION (+2h)"
        ) from None
    if parsed.tzinfo is None:
        raise ValueError(f"deadline {value!r} has no time zone: add one, for example {text}Z for UTC")
    return parsed.astimezone(UTC)
