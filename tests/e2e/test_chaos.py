"""Chaos: seeded runs that SIGKILL real worker processes at random instants (docs/design.md §4.5).

Each run plans a small input with bad lines in it and runs it with ``local.runner.run_job``:
two subprocess workers, Spot-style preemptions at a high Poisson rate (SIGTERM, then SIGKILL
after a notice of zero or a fraction of a second), and in half of the runs workers that also
SIGKILL themselves between writing a microbatch object and committing it. Whatever the
interleaving, every run must end with a published manifest and every invariant holding; the
assertions are the invariants, never a count of kills. One run in five uses PostgreSQL.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from airflow_deadline_batch.core.pools import PoolKind, default_local_pools
from airflow_deadline_batch.core.states import AttemptOutcome
from airflow_deadline_batch.local.runner import PreemptionInjector, RunOptions, run_job
from airflow_deadline_batch.service.planning import PlanRequest
from airflow_deadline_batch.store import ManifestStore, Progress
from tests.helpers.inputs import mixed_input
from tests.helpers.outcomes import (
    assert_outcomes_match,
    assert_store_invariants,
    read_manifest,
    read_outcomes,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SEEDS = range(50)
#: kills observed over the whole module, checked by the last test (chaos must actually happen)
_KILLS: Counter[str] = Counter()


@dataclass(frozen=True)
class Scenario:
    """How one seed stresses the run; derived from the seed so a failure replays exactly.

    Even seeds: workers also SIGKILL themselves between writing an object and committing it,
    under moderate preemptions (a mean of 1.5 s of claimed work between them) with a notice of 0
    or 0.15 s. Odd seeds: the injector alone, at a mean of 1 s of claimed work between
    preemptions and no notice, so its SIGKILL lands about 20 ms (one poll) after the SIGTERM;
    records take 20 ms each, so most kills land in the middle of a microbatch. None lands during
    a worker's start-up, however slow the machine: the injector counts a worker's exposure from
    its claim (``PreemptionInjector``), so the rates are per hour of work, higher than when the
    start-up counted (1200 and 1800 an hour then, most of whose kills hit workers still starting).
    """

    seed: int
    lines: int
    kill_after_write_prob: float
    notice_s: float
    preempt_rate_per_hour: float
    echo_delay_s: float
    postgres: bool

    @classmethod
    def of(cls, seed: int) -> Scenario:
        hook = seed % 2 == 0
        return cls(
            seed=seed,
            lines=(80 + 20 * (seed % 4)) if hook else (60 + 10 * (seed % 4)),
            kill_after_write_prob=0.15 if hook else 0.0,
            notice_s=(0.15 if seed % 3 == 0 else 0.0) if hook else 0.0,
            preempt_rate_per_hour=2400.0 if hook else 3600.0,
            echo_delay_s=0.004 if hook else 0.02,
            postgres=seed % 5 == 4,
        )


def _plan(input_path: Path, output: Path) -> PlanRequest:
    return PlanRequest(
        input_uri=str(input_path),
        deadline=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1),
        output_uri=str(output),
        engine="echo",
        pools=default_local_pools("echo"),
        workers=2,
        microbatch_size=10,
        max_shards=2,
        max_invalid_fraction=0.5,
        max_attempts=1000,  # preemptions are the point here; a shard must never run out of tries
        lease_ttl_s=10.0,
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_seeded_chaos_run_keeps_every_invariant(
    seed: int, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    scenario = Scenario.of(seed)
    mixed = mixed_input(scenario.lines, seed=seed, bad_fraction=0.05, blank_fraction=0.02)
    input_path = mixed.write(tmp_path / "input.jsonl")
    store_url = (
        str(request.getfixturevalue("pg_store_url"))
        if scenario.postgres
        else f"sqlite:///{tmp_path / 'store.db'}"
    )
    store = ManifestStore.open(store_url, migrate=True)
    worker_env = {"ADB_ECHO_DELAY_S": str(scenario.echo_delay_s)}
    if scenario.kill_after_write_prob:
        worker_env["ADB_FAULT_KILL_AFTER_WRITE_PROB"] = str(scenario.kill_after_write_prob)
    plan = _plan(input_path, tmp_path / "out")
    options = RunOptions(
        workers=2,
        preempt_rate_per_worker_hour=scenario.preempt_rate_per_hour,
        preempt_notice_s=scenario.notice_s,
        seed=seed,
        lease_ttl_s=10.0,
        poll_interval_s=0.02,
        worker_env=worker_env,
        worker_log=str(tmp_path / "worker.log"),
    )
    try:
        summary = run_job(store, plan, options)
        assert summary.state == "completed", (summary, (tmp_path / "worker.log").read_text()[-3000:])
        assert summary.manifest is not None
        manifest = read_manifest(summary.manifest)
        assert_outcomes_match(read_outcomes(manifest), mixed)
        assert_store_invariants(store, summary.job_id, manifest)
        assert summary.records["total"] == len(mixed.expected)
        outcomes = Counter(a.outcome for a in store.list_attempts(summary.job_id))
    finally:
        store.close()
    _KILLS["preemptions"] += summary.preemptions
    _KILLS["abandoned"] += outcomes[AttemptOutcome.ABANDONED]  # attempts whose process died of a signal
    if not scenario.kill_after_write_prob:
        _KILLS["abandoned_by_injector"] += outcomes[AttemptOutcome.ABANDONED]
    _KILLS["runs"] += 1


def test_chaos_runs_did_kill_workers() -> None:
    """Guard against a quiet chaos suite: the seeded runs above must have killed many workers."""
    if _KILLS["runs"] < len(SEEDS):
        pytest.skip("only meaningful after all seeded runs in this module")
    assert _KILLS["preemptions"] >= len(SEEDS), _KILLS
    assert _KILLS["abandoned"] >= len(SEEDS) // 2, _KILLS
    # SIGKILLs by the injector itself (notice over mid-microbatch), not only the write/commit hook
    assert _KILLS["abandoned_by_injector"] >= 5, _KILLS


def test_scenarios_cover_both_stores_and_both_kill_kinds() -> None:
    scenarios = [Scenario.of(s) for s in SEEDS]
    assert sum(s.postgres for s in scenarios) >= 5
    assert sum(s.kill_after_write_prob > 0 for s in scenarios) >= len(SEEDS) // 3
    assert {s.notice_s for s in scenarios} >= {0.0, 0.15}


def test_invariant_checks_catch_a_stray_object_and_a_tampered_commit(tmp_path: Path) -> None:
    """The checks above can fail: a leftover attempt object or a changed committed object is caught."""
    mixed = mixed_input(60, seed=99)
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}", migrate=True)
    try:
        summary = run_job(
            store, _plan(mixed.write(tmp_path / "input.jsonl"), tmp_path / "out"), RunOptions(workers=2)
        )
        assert summary.manifest is not None
        manifest = read_manifest(summary.manifest)
        assert_store_invariants(store, summary.job_id, manifest)
        job_dir = Path(summary.manifest).parent
        stray = job_dir / "attempts" / "a-0000" / "shard-00000-mb-000000.jsonl"
        stray.parent.mkdir(parents=True)
        stray.write_bytes(b"{}\n")
        with pytest.raises(AssertionError, match="not collected"):
            assert_store_invariants(store, summary.job_id, manifest)
        stray.unlink()
        victim = Path(store.list_commits(summary.job_id)[-1].uri)
        victim.write_bytes(victim.read_bytes() + b"\n")
        with pytest.raises(AssertionError, match="SHA-256"):
            assert_store_invariants(store, summary.job_id, manifest)
        with pytest.raises(AssertionError, match="SHA-256"):
            read_outcomes(manifest)
    finally:
        store.close()


#: a worker's Python start held back this long (a loaded machine's imports), far past the exposures
SLOW_START_S = 1.5
#: the injector's rate for the slow-start test: a mean of 2 s of claimed work between preemptions
SLOW_START_RATE = 1800.0

#: installed on the workers' PYTHONPATH: each worker waits for the gate file before its imports go on
_GATE_SITECUSTOMIZE = """\
import os, time

_gate = os.environ.get("ADB_TEST_START_GATE")
if _gate:
    _deadline = time.monotonic() + 60.0
    while not os.path.exists(_gate) and time.monotonic() < _deadline:
        time.sleep(0.01)  # the polling interval of a wait with a deadline
"""


def _slow_start_seed(rate_per_hour: float) -> int:
    """A seed whose first two Spot launches are preempted within 0.3 s of their claim (mid-shard:
    a shard's records take 0.6 s) and whose next two run for 5 s (their shards' rest, then done)."""
    for seed in range(100_000):
        injector = PreemptionInjector(rate_per_hour, seed)
        exposures = [injector.exposure_s(PoolKind.SPOT) for _ in range(4)]
        if max(exposures[:2]) < 0.3 and min(exposures[2:]) > 5.0:
            return seed
    raise AssertionError("no seed preempts the first launches early and spares the next ones")


def test_a_slow_starting_worker_is_preempted_only_after_its_claim(tmp_path: Path) -> None:
    """The injector's exposure starts at a worker's claim, not at its launch: the first workers
    start slower than their drawn exposures, and each launch still claims its shard before any
    preemption, which then lands in its work. Counted from the launch, both were preempted before
    claiming (a launch without an attempt), as a loaded machine's slow starts were again and again."""
    gate_dir = tmp_path / "gate"
    gate_dir.mkdir()
    (gate_dir / "sitecustomize.py").write_text(_GATE_SITECUSTOMIZE)
    gate = tmp_path / "gate-open"
    mixed = mixed_input(60, seed=7, bad_fraction=0.0, blank_fraction=0.0)
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}", migrate=True)
    first_poll: list[float] = []

    def open_gate_after_a_slow_start(_: Progress) -> None:
        if not first_poll:
            first_poll.append(time.monotonic())
        elif time.monotonic() - first_poll[0] >= SLOW_START_S:
            gate.touch()

    options = RunOptions(
        workers=2,
        preempt_rate_per_worker_hour=SLOW_START_RATE,
        preempt_notice_s=0.0,
        seed=_slow_start_seed(SLOW_START_RATE),
        lease_ttl_s=10.0,
        poll_interval_s=0.02,
        worker_env={
            # 20 ms a record: each shard works for about 0.6 s after its claim, past its exposure
            "ADB_ECHO_DELAY_S": "0.02",
            "ADB_TEST_START_GATE": str(gate),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(gate_dir), os.environ.get("PYTHONPATH")])),
        },
        worker_log=str(tmp_path / "worker.log"),
    )
    try:
        summary = run_job(
            store,
            _plan(mixed.write(tmp_path / "input.jsonl"), tmp_path / "out"),
            options,
            on_progress=open_gate_after_a_slow_start,
        )
        assert summary.state == "completed", (summary, (tmp_path / "worker.log").read_text()[-3000:])
        attempts = store.list_attempts(summary.job_id)
    finally:
        store.close()
    assert summary.preemptions >= 1, summary
    # every launch claimed its shard: no preemption landed before a claim
    assert sum(summary.placements.values()) == len(attempts), (summary, attempts)
