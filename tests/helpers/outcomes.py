"""Checks of a published job against docs/design.md §4.5, shared by the CLI and chaos tests.

Every function reads the real outputs (``manifest.json`` and every object it lists, through
the package's own storage layer, so local paths and ``s3://`` URIs both work) and the real
manifest store, and raises ``AssertionError`` naming the first broken invariant.
"""

from __future__ import annotations

import functools
import hashlib
from collections import Counter
from collections.abc import Mapping
from typing import Any

import orjson

from airflow_deadline_batch.core.results import RESULT_STATUSES, OutputManifest, ResultRecord
from airflow_deadline_batch.core.states import AttemptOutcome
from airflow_deadline_batch.storage import open_storage, open_uri
from airflow_deadline_batch.store import ManifestStore
from tests.helpers.inputs import MixedInput

STATUSES = RESULT_STATUSES


@functools.lru_cache(maxsize=1)
def _s3_client() -> Any:
    from airflow_deadline_batch.storage.s3 import make_client

    return make_client()  # one per test process: building a client costs 0.1-0.3 s


def read_bytes(uri: str) -> bytes:
    storage, key = open_uri(uri, client=_s3_client()) if uri.startswith("s3://") else open_uri(uri)
    return storage.get_bytes(key)


def read_manifest(uri: str) -> dict[str, Any]:
    """The published manifest as a dict, after checking it against the format (``OutputManifest``)."""
    data = read_bytes(uri)
    OutputManifest.from_json_bytes(data)
    return dict(orjson.loads(data))


def read_outcomes(manifest: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    """Every outcome listed by the manifest, by line; checks checksums, counts and uniqueness."""
    outcomes: dict[int, dict[str, Any]] = {}
    for entry in manifest["shards"]:
        data = read_bytes(entry["uri"])
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], (
            f"{entry['uri']} fails its manifest SHA-256"
        )
        lines = [raw for raw in data.splitlines() if raw.strip()]
        for raw in lines:  # every line follows the result record format (``ResultRecord``)
            ResultRecord.parse_line(raw)
        records = [orjson.loads(raw) for raw in lines]
        assert len(records) == entry["records"], (
            f"{entry['uri']} holds {len(records)}, manifest says {entry['records']}"
        )
        for rec in records:
            assert rec["attempt_id"] == entry["attempt_id"], (
                f"line {rec['line']}: attempt differs from its object's"
            )
            assert rec["status"] in STATUSES, f"line {rec['line']}: unknown status {rec['status']!r}"
            assert rec["line"] not in outcomes, f"line {rec['line']} has two outcomes"
            outcomes[rec["line"]] = rec
    counts = Counter(rec["status"] for rec in outcomes.values())
    assert {s: counts.get(s, 0) for s in STATUSES} == {s: manifest["outcomes"].get(s, 0) for s in STATUSES}
    return outcomes


def assert_outcomes_match(
    outcomes: Mapping[int, Mapping[str, Any]], mixed: MixedInput, *, check_output: bool = True
) -> None:
    """Exactly one outcome per non-blank line, with the right status, code, ID (and echo output)."""
    expected = mixed.by_line
    missing = sorted(set(expected) - set(outcomes))
    unknown = sorted(set(outcomes) - set(expected))
    assert not missing, f"{len(missing)} lines have no outcome, e.g. {missing[:5]}"
    assert not unknown, f"{len(unknown)} outcomes for lines that are blank or absent, e.g. {unknown[:5]}"
    for line, want in expected.items():
        got = outcomes[line]
        assert got["id"] == want.id, f"line {line}: id {got['id']!r}, expected {want.id!r}"
        assert got["status"] == want.status, (
            f"line {line}: {got['status']} ({got.get('error')}), expected {want}"
        )
        if want.status == "errored":
            assert got["error"]["code"] == want.code, (
                f"line {line}: code {got['error']}, expected {want.code}"
            )
            assert got["output"] is None
        elif check_output and want.output is not None:
            assert got["output"] == want.output, (
                f"line {line}: output {got['output']!r}, expected {want.output!r}"
            )


def assert_store_invariants(store: ManifestStore, job_id: str, manifest: Mapping[str, Any]) -> None:
    """Fencing, completeness, garbage collection and progress, read from the store and storage.

    * every commit belongs to an attempt of the same shard with the same epoch, made while that
      attempt was alive (committed no later than the attempt ended): docs/design.md §4.5 invariant 2;
    * each shard has exactly one commit per microbatch ``0..n-1`` and its objects' SHA-256 hold;
    * the manifest lists exactly the committed objects, and no attempt object outside them
      remains under ``<job>/attempts/`` (uncommitted attempts were garbage-collected);
    * progress counts equal the committed outcomes: docs/design.md §4.5 invariant 4.
    """
    job = store.get_job(job_id)
    assert job.manifest_uri, f"job {job_id} has no published manifest (state {job.state})"
    shards = {s.shard_index: s for s in store.list_shards(job_id)}
    attempts = {a.attempt_id: a for a in store.list_attempts(job_id)}
    commits = store.list_commits(job_id)
    per_seq = Counter((c.shard_index, c.seq) for c in commits)
    assert all(n == 1 for n in per_seq.values()), f"microbatches committed twice: {per_seq.most_common(3)}"
    for index, shard in shards.items():
        seqs = sorted(c.seq for c in commits if c.shard_index == index)
        assert seqs == list(range(shard.num_microbatches)), f"shard {index}: committed seqs {seqs}"
        assert shard.cursor == shard.num_microbatches
        # an unschedulable try never held a lease (store.pool_stats.NO_LEASE_EPOCH)
        epochs = [
            a.epoch
            for a in attempts.values()
            if a.shard_index == index and a.outcome is not AttemptOutcome.UNSCHEDULABLE
        ]
        assert len(epochs) == len(set(epochs)), (
            f"shard {index}: two attempts share an epoch: {sorted(epochs)}"
        )
    for c in commits:
        assert hashlib.sha256(read_bytes(c.uri)).hexdigest() == c.sha256, f"commit {c.uri} fails its SHA-256"
        if c.shard_index < 0:
            continue  # the planner's validation object
        attempt = attempts.get(c.attempt_id)
        assert attempt is not None, f"commit {c.shard_index}/{c.seq} by unknown attempt {c.attempt_id}"
        assert (attempt.shard_index, attempt.epoch) == (c.shard_index, c.epoch), (
            f"commit {c.shard_index}/{c.seq} has epoch {c.epoch}; its attempt holds "
            f"shard {attempt.shard_index} epoch {attempt.epoch}"
        )
        if attempt.ended_at is not None:
            assert c.committed_at <= attempt.ended_at, (
                f"commit {c.shard_index}/{c.seq} after its attempt ended"
            )
    committed_uris = {c.uri for c in commits}
    assert {s["uri"] for s in manifest["shards"]} == committed_uris, "manifest and committed objects differ"
    output = open_storage(job.output_uri)
    leftovers = [output.uri(k) for k in output.list_keys("attempts/") if output.uri(k) not in committed_uris]
    assert not leftovers, f"{len(leftovers)} uncommitted attempt objects were not collected: {leftovers[:3]}"
    progress = store.progress(job_id)
    assert progress.committed_records == sum(c.records for c in commits) == job.input_lines
    assert progress.succeeded == manifest["outcomes"]["succeeded"]
    assert progress.errored == manifest["outcomes"]["errored"]
