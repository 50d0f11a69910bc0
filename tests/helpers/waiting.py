"""Waiting on a condition with a deadline: the one polling loop the tests share (never a fixed sleep)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T | None], *, timeout_s: float, what: str, interval_s: float = 0.05
) -> T:
    """Poll ``condition`` until it returns a truthy value or ``timeout_s`` passes (no fixed sleeps)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)  # the polling interval of a wait with a deadline
