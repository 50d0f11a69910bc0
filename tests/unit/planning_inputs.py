"""Deterministic, messy planning inputs shared by the planning tests (not a test module).

Lines mix every shape the planner sees: native prompts and chats, OpenAI Batch lines with
parameters, invalid lines that carry an ID (so they own it), invalid lines without one, blank and
white-space lines, CRLF endings, a BOM, over-long lines whose head carries an ID, long and short
IDs, odd Unicode IDs, and IDs drawn from a small pool so that many lines repeat an earlier ID.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import random
from pathlib import Path
from typing import Any

import orjson

from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.core.records import ValidationLimits

MAX_LINE_BYTES = 2_000
ODD_IDS = (
    "é",
    "e\u0301",  # the same letter, decomposed: a different ID
    "\U0001f600",
    "😀x",
    "\u0000nul",
    "tab\tid",
    '"quoted"',
    "back\\slash",
    "\u2028line-sep",
    "ﬁ",
    "x" * 17,  # one past the short-ID length
    "y" * 300,  # a long ID
    "Ω" * 40,
)
WORDS = ("the", "batch", "plans", "résumé", "tonight", "shards", "deadline", "Spot", "日本語", "GPU")


def _id(rng: random.Random, pool: int) -> str:
    roll = rng.random()
    if roll < 0.15:
        return rng.choice(ODD_IDS)
    if roll < 0.25:
        return f"long-identifier-{rng.randrange(pool):08d}-" + "z" * rng.randrange(0, 40)
    return f"r{rng.randrange(pool)}"


def _text(rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(1, 60)))


def make_line(rng: random.Random, pool: int) -> bytes:
    """One input line (without its ending), of a kind picked at random."""
    kind = rng.randrange(20)
    rid = _id(rng, pool)
    text = _text(rng)
    if kind <= 5:
        obj: dict[str, Any] = {"id": rid, "prompt": text}
        if rng.random() < 0.5:
            obj["max_tokens"] = rng.randint(1, 400)
        return orjson.dumps(obj)
    if kind <= 8:
        return orjson.dumps(
            {
                "id": rid,
                "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}],
            }
        )
    if kind <= 10:
        body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": text}]}
        if rng.random() < 0.5:
            body["max_tokens"] = rng.randint(1, 300)
        if rng.random() < 0.3:
            body["temperature"] = 0.5
        return orjson.dumps({"custom_id": rid, "method": "POST", "url": "/v1/chat/completions", "body": body})
    if kind == 11:  # invalid, but it carries an ID: it owns the ID
        return orjson.dumps({"id": rid, "prompt": "   "})
    if kind == 12:
        return orjson.dumps({"id": rid, "prompt": text, "max_tokens": -3})
    if kind == 13:
        return b'{"id": "' + rid.encode("utf-8", "surrogatepass").replace(b'"', b"") + b'", "prompt": '
    if kind == 14:
        return orjson.dumps({"prompt": text})
    if kind == 15:
        return b"\xff\xfe" + text.encode()
    if kind == 16:
        return rng.choice((b"", b"   ", b"\t"))
    if kind == 17:  # over-long: its head carries the ID
        return orjson.dumps({"id": rid, "prompt": "w " * (MAX_LINE_BYTES // 2 + rng.randrange(50))})
    if kind == 18:
        return b'{"id": "\\ud800", "prompt": "lone surrogate"}'
    return orjson.dumps(
        {"custom_id": rid, "method": "POST", "url": "/v1/embeddings", "body": {"input": text}}
    )


def write_input(path: Path, lines: int, seed: int, *, pool: int | None = None) -> Path:
    """Write ``lines`` messy lines to ``path`` (deterministic in ``seed``)."""
    rng = random.Random(seed)
    pool = pool or max(2, lines // 3)
    parts = [b"\xef\xbb\xbf"] if seed % 2 else []
    for i in range(lines):
        parts.append(make_line(rng, pool))
        last = i == lines - 1
        if not (last and seed % 3 == 0):  # some inputs end without a final newline
            parts.append(b"\r\n" if rng.random() < 0.1 else b"\n")
    path.write_bytes(b"".join(parts))
    return path


def plan_request(input_path: Path, **overrides: Any) -> Any:
    """A request whose work spreads over many shards (the slow CPU pools, eight workers)."""
    from airflow_deadline_batch.service.planning import PlanRequest

    values: dict[str, Any] = {
        "input_uri": str(input_path),
        "deadline": dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc),
        "output_uri": str(input_path.parent / "out"),
        "engine": "transformers",
        "pools": default_local_pools("transformers"),
        "workers": 8,
        "max_shards": 64,
        "max_invalid_fraction": 1.0,
        "limits": ValidationLimits(max_line_bytes=MAX_LINE_BYTES),
    }
    values.update(overrides)
    return PlanRequest(**values)


def summarize(analysis: Any) -> dict[str, Any]:
    """Everything of an analysis that must not change when the planner's internals do."""
    spool = analysis.error_spool
    position = spool.tell()
    errors = spool.read()
    spool.seek(position)
    work = analysis.work
    return {
        "total_lines": analysis.total_lines,
        "outcome_lines": analysis.outcome_lines,
        "records": work.records,
        "invalid": work.invalid,
        "prompt_tokens": work.prompt_tokens,
        "output_tokens": work.output_tokens,
        "gpu_seconds": work.gpu_seconds.hex(),
        "target_shard_s": analysis.target_shard_s.hex(),
        "errors_by_code": dict(sorted(analysis.errors_by_code.items())),
        "error_spool_sha256": hashlib.sha256(errors).hexdigest(),
        "error_spool_lines": errors.count(b"\n"),
        "verdict": analysis.report.verdict.value,
        "cuts": [
            [
                c.index,
                c.byte_start,
                c.byte_end,
                c.first_line,
                c.line_count,
                c.records,
                list(c.excluded_lines),
                c.est_work_s.hex(),
            ]
            for c in analysis.cuts
        ],
    }
