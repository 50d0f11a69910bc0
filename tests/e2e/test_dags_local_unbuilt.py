"""A mapped shard instance that Airflow cannot build is no spent shard (s27), under ``dag.test()``.

A value only the mapped XCom gives (here ``preempt_tries``, from ``expand_kwargs(plan.output.map(f))``)
that the shard operator's constructor refuses fails the try in the worker while Airflow unmaps the
instance, before any operator code: the parse-time probe cannot see it. Airflow retries it as an
ordinary failure; at the last try the task's failure callback (``note_unbuilt_instance``, added by
``ShardPartial``) pushes ``configuration_error``, so the sensor after the shards leaves the shard
to run instead of failing it in the store and publishing the job ``partial``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from airflow_deadline_batch.core.states import ShardState
from airflow_deadline_batch.store import ManifestStore
from tests.e2e.test_dags_local import Derived, derived_examples, run_derived_example, states

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: the local example, shard 1's instance mapped with a ``preempt_tries`` the constructor refuses
SHARD_1_UNBUILT = [
    ("        preempt_tries=PREEMPT_TRIES,\n", ""),
    (
        "    shards = LocalShardOperator.partial(\n",
        "    def configure(spec):\n"
        "        return {**spec, 'preempt_tries': ['x'] if spec['shard_index'] == 1 else []}\n\n"
        "    shards = LocalShardOperator.partial(\n",
    ),
    ("    ).expand_kwargs(plan.output)\n", "    ).expand_kwargs(plan.output.map(configure))\n"),
]


@pytest.fixture(scope="module")
def derived(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Derived]:
    with derived_examples(tmp_path_factory) as runs:
        yield runs


def test_an_instance_its_constructor_refuses_leaves_its_shard_to_run(derived, tmp_path):
    """Before, the sensor failed shard 1 in the store (``its Airflow task shard[1] failed for
    good``) and published the job ``partial``, shard 1's records ``shard_failed`` for a typo."""
    result, output, _ = run_derived_example(derived, tmp_path, SHARD_1_UNBUILT)

    assert result["state"] == "failed" and states(result, "plan") == ["success"], output[-5000:]
    shard_tis = {index: (state, tries) for index, state, tries in result["tasks"]["shard"]}
    assert shard_tis.pop(1) == ("failed", 5), result["tasks"]  # Airflow's retries: no operator code ran
    assert shard_tis and {state for state, _ in shard_tis.values()} == {"success"}
    assert states(result, "verify") == ["failed"] and states(result, "summarise") == ["upstream_failed"]
    (line,) = [
        line for line in output.splitlines() if "shard task shard[1] failed on a configuration" in line
    ]
    assert (
        "(shard[1]: LocalShardOperator refuses the arguments of this mapped instance (invalid "
        "literal for int() with base 10: 'x'); fix them in the DAG file or in the values "
        "expand_kwargs maps)"
    ) in line
    assert line.endswith("fix it, then clear shard[1] and verify: the job stays open, nothing was published")
    assert "shard[1] failed for good" not in output
    assert result["manifest"] is None and result["asset_events"] == []
    assert result["job_state"] in ("admitted", "running"), result

    store = ManifestStore(derived.store_url)
    try:
        shards = {s.shard_index: s for s in store.list_shards(result["job_id"])}
        assert shards.pop(1).state is ShardState.PENDING
        assert {s.state for s in shards.values()} == {ShardState.SUCCEEDED}
    finally:
        store.close()
