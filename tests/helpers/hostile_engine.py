"""An engine that misbehaves on cue, run inside the real worker program.

``python -m tests.helpers.hostile_engine WORKER-ARGS...`` registers it as the engine ``hostile``
and runs ``python -m airflow_deadline_batch.worker`` with the same arguments, so a job whose
config names ``engine: hostile`` meets it in a real worker process (real store, real storage,
real signals). A record behaves like the echo engine's unless its prompt holds a marker:

* ``__surrogate__``: its output holds a lone surrogate (what an endpoint's JSON ``"\\ud800"`` decodes to);
* ``__nan_logprob__``: its one choice has a log probability that is not a number;
* ``__bad_finish__``: its finish reason is one the result format does not know;
* ``__huge_usage__``: it reports more completion tokens than 64 bits hold;
* ``__exit__``: the engine calls ``sys.exit(0)`` in the middle of the microbatch;
* ``__hang__``: the engine blocks forever (until the process dies), making no progress.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Sequence
from typing import Any

from airflow_deadline_batch.core.records import Request
from airflow_deadline_batch.core.results import Choice, TokenLogprob
from airflow_deadline_batch.worker import engines
from airflow_deadline_batch.worker.engines.base import Generation, GenerationParams, prompt_text, text_digest
from airflow_deadline_batch.worker.engines.echo import echo_one

NAME = "hostile"


class HostileEngine:
    name = NAME
    model_name = "hostile-v1"
    model_digest = text_digest("hostile-v1")

    def load(self) -> None:
        """Nothing to load."""

    def generate(self, requests: Sequence[Request], params: GenerationParams) -> list[Generation]:
        return [self._one(r, params.for_request(r)) for r in requests]

    def _one(self, request: Request, params: GenerationParams) -> Generation:
        text = prompt_text(request)
        if "__exit__" in text:
            sys.exit(0)
        if "__hang__" in text:
            threading.Event().wait()  # no progress, ever: the process must be ended from outside
        if "__surrogate__" in text:
            return Generation("before \ud800 after", None, 3, 3, finish_reason="stop")
        if "__nan_logprob__" in text:
            choice = Choice(index=0, text="x", logprobs=(TokenLogprob(token="x", logprob=math.nan),))
            return Generation("x", None, 3, 1, choices=(choice,))
        if "__bad_finish__" in text:
            return Generation("x", None, 3, 1, finish_reason="content_filter")  # type: ignore[arg-type]
        if "__huge_usage__" in text:
            return Generation("x", None, 3, 2**70)
        return echo_one(request, params)


def build(model: str | None, options: dict[str, Any]) -> HostileEngine:
    return HostileEngine()


def check(model: str | None, options: dict[str, Any]) -> None:
    """Nothing to check."""


def main(argv: Sequence[str]) -> int:
    engines.ENGINES[NAME] = "tests.helpers.hostile_engine"  # this module, imported by name
    from airflow_deadline_batch.worker.__main__ import main as worker_main

    return worker_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
