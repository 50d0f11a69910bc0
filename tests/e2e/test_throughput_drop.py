"""On-call before the miss: the engine slows down mid-job (on cue), the at-risk alert fires once,
before the deadline, naming the throughput drop, and the next tries escalate to on-demand; the
deadline is missed anyway, so the unfinished records expire in a verified partial manifest.

A real ``deadline-batch run`` (local workers, echo engine, SQLite store) does the work; the test
process watches it with the real :class:`CompletenessTrigger` and its risk watch, resuming it
after each ``risk`` event with the kwargs the event carries, as the deferrable sensor does. The cue
is the echo engine's delay file (``ADB_ECHO_DELAY_FILE``), read again for every microbatch.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from airflow_deadline_batch.core.pools import PoolKind
from airflow_deadline_batch.store import ManifestStore
from airflow_deadline_batch.triggers.completeness import CompletenessStatus, CompletenessTrigger
from tests.e2e.conftest import cli_argv, cli_env, wait_for
from tests.helpers.outcomes import read_manifest, read_outcomes

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: the pools the job declares: a CPU "GPU" doing 3,000 tokens/s, which the echo engine about
#: matches before the cue (a record is estimated at ~0.18 s) and falls 5x behind after it
RATE = 3000.0
POOLS = [
    {"name": "cpu-spot", "kind": "spot", "gpus": 1, "price_per_gpu_hour": 1.0, "startup_seconds": 1,
     "prefill_tokens_per_s": RATE, "decode_tokens_per_s": RATE, "preemptions_per_hour": 6,
     "preemption_notice_seconds": 1},
    {"name": "cpu-on-demand", "kind": "on_demand", "gpus": 1, "price_per_gpu_hour": 3.0,
     "startup_seconds": 1, "prefill_tokens_per_s": RATE, "decode_tokens_per_s": RATE},
]  # fmt: skip
#: seconds per record before and after the cue
FAST_S, SLOW_S = 0.15, 0.9
#: admission needs the work (~30 s), a startup and the 60 s recovery reserve
DEADLINE_S = 110
#: alert when the predicted finish comes within this of the deadline: ~75 s of slack before the
#: cue; three slow microbatches later (the measured rate moving at most 4x per microbatch) it is
#: ~20 s, where the time passed alone would have left ~60 s
THRESHOLD_S = 40.0
WORDS = "the quick brown fox jumps over a lazy dog while rain falls softly on quiet hills".split()  # noqa: SIM905


def long_records(path: Path, count: int) -> Path:
    """``count`` chat requests of 300 words each (max_tokens 32): work that calibration can see."""
    lines = []
    for i in range(count):
        text = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(300))
        line = {"id": f"r{i:04d}", "messages": [{"role": "user", "content": text}], "max_tokens": 32}
        lines.append(orjson.dumps(line))
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def watch(store_url: str, job_id: str, timeout_at: dt.datetime) -> list[dict[str, Any]]:
    """Run the trigger to the job's end as the sensor would; every event it yielded, in order."""
    kwargs: dict[str, Any] = {
        "job_id": job_id,
        "store_url": store_url,
        "poll_interval_s": 0.5,
        "timeout_at": timeout_at.isoformat(),
        "risk_threshold_s": THRESHOLD_S,
    }
    events: list[dict[str, Any]] = []

    async def first_event(trigger: CompletenessTrigger) -> dict[str, Any]:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("the trigger yielded nothing")

    while True:
        payload = asyncio.run(first_event(CompletenessTrigger(**kwargs)))
        events.append({**payload, "seen_at": dt.datetime.now(dt.timezone.utc)})
        if payload["status"] != CompletenessStatus.RISK.value:
            return events
        kwargs = dict(payload["resume"])  # the watch's state travels in the kwargs


def test_a_throughput_drop_alerts_once_before_the_deadline_and_escalates(tmp_path: Path) -> None:
    path = long_records(tmp_path / "input.jsonl", 160)
    pools = tmp_path / "pools.json"
    pools.write_bytes(orjson.dumps(POOLS))
    delay = tmp_path / "delay"
    delay.write_text(str(FAST_S))
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    key = "slowed"
    argv = cli_argv(
        "run", str(path), "--deadline", f"+{DEADLINE_S}s", "--engine", "echo", "--workers", "1",
        "--microbatch-size", "8", "--pools", str(pools), "--store", store_url,
        "--output", str(tmp_path / "out"), "--idempotency-key", key, "--json",
    )  # fmt: skip
    env = cli_env({"ADB_ECHO_DELAY_FILE": str(delay)})
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    store = ManifestStore.open(store_url, migrate=True)
    try:

        def committed() -> str | None:
            job = store.get_job_by_idempotency_key(key)
            return job.job_id if job and store.progress(job.job_id).committed_records >= 16 else None

        job_id = wait_for(committed, timeout_s=120, what="the first commits at full speed")
        job = store.get_job(job_id)
        cue = dt.datetime.now(dt.timezone.utc)
        delay.write_text(str(SLOW_S))  # the cue: every worker slows down from its next microbatch
        events = watch(store_url, job_id, job.deadline + dt.timedelta(seconds=30))
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    summary = orjson.loads(stdout.strip().splitlines()[-1])

    alerts = [e for e in events if e["status"] == "risk" and e.get("risk")]
    assert len(alerts) == 1, events  # once per crossing, and the slack never came back
    (alert,) = alerts
    assert cue < alert["seen_at"] < job.deadline  # before the miss, after the drop
    assert alert["risk"]["slack_s"] < THRESHOLD_S
    assert any("throughput drop" in cause for cause in alert["risk"]["causes"]), alert["risk"]
    assert events[-1]["status"] != "risk"  # the watch ended with the job

    # the placement escalated: the first shard went to Spot at full speed; the one launched after
    # the alert, with the slack gone, on-demand
    kinds = {p["name"]: PoolKind(p["kind"]) for p in POOLS}
    attempts = sorted(store.list_attempts(job_id), key=lambda a: a.started_at)
    tries = [(a.started_at.isoformat(), a.shard_index, a.pool) for a in attempts]
    assert kinds[attempts[0].pool] is PoolKind.SPOT, tries
    after = [a for a in attempts if a.started_at > alert["seen_at"]]
    assert after and {kinds[a.pool] for a in after} == {PoolKind.ON_DEMAND}, tries
    assert summary["job_id"] == job_id, (summary, stderr[-2000:])
    # the drop cost the deadline: what did not finish expired, and the partial manifest verifies
    assert summary["state"] == "partial" and summary["deadline_met"] is False, summary
    assert summary["records"]["expired"] > 0 and summary["verified"] is True, summary
    outcomes = read_outcomes(read_manifest(summary["manifest"]))
    assert sorted(outcomes) == list(range(1, 161))  # one outcome per line
    assert sum(r["status"] == "expired" for r in outcomes.values()) == summary["records"]["expired"]
    store.close()
