"""A messy job built through the store's worker calls (no engine), for golden tests of what the
finalizer and the export write.

The planner's validation object (bad and blank lines), a shard that succeeded over two
microbatches after a preempted attempt whose object never committed, a shard that failed for
good after one commit, a shard with one commit left running and shards with none. Succeeded
records vary in shape when ``rich`` (``finish_reason``, several choices, logprobs), so an
export covers every branch of its body; without it they are the plain ``echo N`` the finalizer's
golden copy was written with.
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path
from typing import Any

import orjson

from airflow_deadline_batch.core.failures import FailureClass
from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.core.results import (
    Choice,
    ResultRecord,
    TokenLogprob,
    TopLogprob,
    Usage,
    encode_results,
)
from airflow_deadline_batch.core.shard_input import limits_from_config, parse_shard
from airflow_deadline_batch.core.states import ShardState
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.storage import open_storage, open_uri, sha256_hex
from airflow_deadline_batch.store import ManifestStore
from airflow_deadline_batch.worker.worker import object_key
from tests.helpers.commits import commit
from tests.helpers.inputs import mixed_input

MICROBATCH = 5


def _succeeded(r: Any, shard_id: str, attempt_id: str, rich: bool) -> ResultRecord:
    usage = Usage(prompt_tokens=r.line % 7 + 1, completion_tokens=2)
    common = {"line": r.line, "id": r.id, "usage": usage, "shard_id": shard_id, "attempt_id": attempt_id}
    kind = r.line % 4 if rich else 0
    if kind == 1:
        return ResultRecord.succeeded(output=f"echo {r.line}", finish_reason="length", **common)
    if kind == 2:
        choices = tuple(Choice(index=i, text=f"echo {r.line}/{i}", finish_reason="stop") for i in range(2))
        return ResultRecord.succeeded(output=choices[0].text, choices=choices, **common)
    if kind == 3:
        logprobs = (
            TokenLogprob(token="é", logprob=-0.25, top_logprobs=(TopLogprob(token="e", logprob=-1.5),)),
            TokenLogprob(token=f" {r.line}", logprob=-0.125),
        )
        choice = Choice(index=0, text=f"é {r.line}", logprobs=logprobs)
        return ResultRecord.succeeded(output=choice.text, choices=(choice,), **common)
    return ResultRecord.succeeded(output=f"echo {r.line}", **common)


def _commit(
    store: ManifestStore, output: Any, lease: Any, shard: Any, records: list[Any], seq: int, rich: bool
) -> None:
    shard_id = f"{shard.shard_index:05d}"
    results = [_succeeded(r, shard_id, lease.attempt_id, rich) for r in records]
    # a microbatch is written in length order, not line order: the export must sort it back
    if rich:
        results.sort(key=lambda rec: (len(rec.output or ""), -rec.line))
    data = encode_results(results)
    uri = output.put_bytes(object_key(lease.attempt_id, shard.shard_index, seq), data)
    commit(
        store,
        lease,
        seq,
        uri=uri,
        sha256=sha256_hex(data),
        records=len(results),
        counts={"succeeded": len(results), "errored": 0},
        prompt_tokens=sum(r.usage.prompt_tokens for r in results),
        completion_tokens=sum(r.usage.completion_tokens for r in results),
        elapsed_s=1.0,
        model_digest="sha256:golden",
    )


def build_messy_job(
    store: ManifestStore, tmp_path: Path, output_uri: str | None = None, *, rich: bool = False
) -> str:
    """Plan the messy input and make the workers' store calls; return the job ID (not finalized)."""
    mixed = mixed_input(160, seed=14, bad_fraction=0.08, blank_fraction=0.03)
    input_path = mixed.write(tmp_path / "input.jsonl")
    plan = plan_job(
        store,
        PlanRequest(
            input_uri=str(input_path),
            deadline=dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc),
            output_uri=output_uri or str(tmp_path / "out"),
            engine="echo",
            pools=default_local_pools("echo"),
            workers=4,
            microbatch_size=MICROBATCH,
            max_shards=5,
            max_invalid_fraction=0.5,
            max_attempts=1,
            allow_infeasible=True,
        ),
    )
    job = store.get_job(plan.job_id)
    shards = store.list_shards(job.job_id)
    assert len(shards) >= 4, f"the messy job needs at least 4 shards, the plan cut {len(shards)}"
    output = open_storage(job.output_uri)
    source, key = open_uri(job.input_uri)
    limits = limits_from_config(job.config)

    def records_of(shard: Any) -> list[Any]:
        data = source.read_range(key, shard.byte_start, shard.byte_end)
        return parse_shard(data, shard, limits)

    # shard 0: a preempted attempt writes an object it never commits, a second one succeeds
    s0 = shards[0]
    lease = store.claim_shard(job.job_id, 0, ttl_s=600, worker="w0")
    output.put_bytes(f"attempts/{lease.attempt_id}/shard-00000-mb-000000.jsonl", b'{"stray": 1}\n')
    store.fail_attempt(lease, FailureClass.PREEMPTED, "spot reclaim")
    lease = store.claim_shard(job.job_id, 0, ttl_s=600, worker="w0")
    recs = records_of(s0)
    for seq in range(s0.num_microbatches):
        _commit(store, output, lease, s0, recs[seq * MICROBATCH : (seq + 1) * MICROBATCH], seq, rich)
    store.complete_shard(lease)
    # shard 1: one commit, then a terminal error ends it for good
    s1 = shards[1]
    lease = store.claim_shard(job.job_id, 1, ttl_s=600, worker="w1")
    _commit(store, output, lease, s1, records_of(s1)[:MICROBATCH], 0, rich)
    store.fail_attempt(
        lease, FailureClass.DETERMINISTIC, "CUDA error: illegal memory access", outcome="failed_terminal"
    )
    assert store.get_shard(job.job_id, 1).state is ShardState.TERMINAL_FAILURE
    # shard 2: one commit, still running when the deadline passes
    s2 = shards[2]
    lease = store.claim_shard(job.job_id, 2, ttl_s=600, worker="w2")
    _commit(store, output, lease, s2, records_of(s2)[:MICROBATCH], 0, rich)
    # the other shards never started
    return job.job_id


def normalized_outputs(store: ManifestStore, job_id: str, tmp_path: Path) -> dict[str, str]:
    """Every object the job published, keyed by its relative name, with placeholders for what varies."""
    job = store.get_job(job_id)
    output = open_storage(job.output_uri)
    texts = {
        key: output.get_bytes(key).decode()
        for key in ["manifest.json", *output.list_keys("finalize/"), *output.list_keys("validation/")]
    }
    manifest = orjson.loads(texts["manifest.json"])
    fixed = ("plan", "finalize")
    attempts = list(
        dict.fromkeys(s["attempt_id"] for s in manifest["shards"] if s["attempt_id"] not in fixed)
    )
    replace = [(job_id, "JOB"), (str(tmp_path), "TMP"), (manifest["created_at"], "CREATED")]
    replace += [(a, f"ATTEMPT{i}") for i, a in enumerate(attempts)]
    # a microbatch object holds its attempt's random ID, so its checksum varies too
    shas = [s["sha256"] for s in manifest["shards"] if s["attempt_id"] not in fixed]
    replace += [(sha, f"SHA{i}") for i, sha in enumerate(shas)]
    out = {}
    for key, text in texts.items():
        for old, new in replace:
            text = text.replace(old, new)
        # the attempts' GPU time is measured on the store's clock
        out[key] = re.sub(r'"gpu_seconds": [0-9.e+-]+', '"gpu_seconds": GPU', text)
    return out
