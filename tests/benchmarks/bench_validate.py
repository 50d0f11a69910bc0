"""Benchmark: the planning hot loop (split, parse, validate, estimate, cut) over a large JSONL input.

Compares against the leanest baseline that reads the same file (``for line in f: json.loads``)
and reports throughput and the memory the duplicate check holds. Targets: one million records
planned in well under a minute on one core, ID digests well under 150 MB.

    .venv/bin/python tests/benchmarks/bench_validate.py [--records 1000000] [--invalid 0.01] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import tempfile
import time
from array import array
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from airflow_deadline_batch.core.estimate import WorkModel, WorkSummaryBuilder  # noqa: E402
from airflow_deadline_batch.core.packing import cut_contiguous  # noqa: E402
from airflow_deadline_batch.core.records import Record, ValidationLimits, Validator, iter_raw_lines  # noqa: E402

WORDS = (
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "data",
    "engineers",
    "plan",
    "tonight's",
    "batch",
)


def write_input(path: Path, records: int, invalid: float, seed: int) -> int:
    """Write a realistic mix: native prompts, chat lines, OpenAI Batch lines and some bad lines."""
    rng = random.Random(seed)
    with path.open("wb", buffering=1 << 20) as out:
        for i in range(records):
            roll = rng.random()
            text = " ".join(rng.choices(WORDS, k=rng.randint(5, 300)))
            if roll < invalid / 2:
                line = b'{"id": "broken", "prompt": '
            elif roll < invalid:
                line = orjson.dumps({"id": f"r{i}", "prompt": "  "})
            elif roll < 0.5:
                line = orjson.dumps({"id": f"r{i}", "prompt": text, "max_tokens": 128, "metadata": {"n": i}})
            elif roll < 0.8:
                line = orjson.dumps(
                    {
                        "id": f"r{i}",
                        "messages": [
                            {"role": "system", "content": "Summarise in one sentence."},
                            {"role": "user", "content": text},
                        ],
                    }
                )
            else:
                line = orjson.dumps(
                    {
                        "custom_id": f"r{i}",
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": {
                            "model": "m",
                            "max_tokens": 64,
                            "temperature": 0,
                            "messages": [{"role": "user", "content": text}],
                        },
                    }
                )
            out.write(line + b"\n")
    return path.stat().st_size


def baseline(path: Path) -> float:
    start = time.perf_counter()
    with path.open("rb") as f:
        for line in f:
            try:  # noqa: SIM105 - contextlib.suppress costs more than the loop body it measures
                json.loads(line)
            except ValueError:
                pass
    return time.perf_counter() - start


def plan(path: Path) -> tuple[float, dict[str, float]]:
    limits = ValidationLimits()
    validator = Validator(limits)
    builder = WorkSummaryBuilder(WorkModel(20_000, 1_500), default_max_tokens=256)
    work = array("d")
    start = time.perf_counter()
    with path.open("rb") as f:
        for raw in iter_raw_lines(f, max_line_bytes=limits.max_line_bytes):
            outcome = validator.feed(raw)
            seconds = builder.add(outcome)
            if isinstance(outcome, Record):
                work.append(seconds)
    parsed = time.perf_counter()
    shards = cut_contiguous(work, target_seconds=600, max_shards=1024)
    done = time.perf_counter()
    summary = builder.build()
    return done - start, {
        "parse_validate_estimate_s": parsed - start,
        "cut_s": done - parsed,
        "records": summary.records,
        "invalid": summary.invalid,
        "shards": len(shards),
        "gpu_hours": summary.gpu_seconds / 3600,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--invalid", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "input.jsonl"
        size = write_input(path, args.records, args.invalid, args.seed)
        base_s = baseline(path)
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        total_s, detail = plan(path)
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = {
        "lines": args.records,
        "input_mb": round(size / 1e6, 1),
        "baseline_json_loads_s": round(base_s, 2),
        "plan_s": round(total_s, 2),
        "records_per_s": round(args.records / total_s),
        "ratio_vs_baseline": round(total_s / base_s, 2),
        "peak_rss_growth_mb": round((rss_after - rss_before) / 1024, 1),
        **{k: round(v, 2) if isinstance(v, float) else v for k, v in detail.items()},
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>28}: {value}")


if __name__ == "__main__":
    main()
