"""A shard operator's constructor refusing a ``partial()`` argument is a DAG import error (s27).

Airflow runs a mapped operator's constructor only in the worker, when it unmaps one instance,
before any of the operator's code: an argument it refuses failed every try there as an ordinary
failure, retried, and then the completeness sensor failed the shard for good (published
``partial`` for a typo). ``ShardPartial.expand_kwargs`` now unmaps a probe the worker's way while
the DAG file is parsed. Real DAG files parsed by Airflow's ``DagBag``; no DAG is run.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG
from airflow.sdk.definitions.mappedoperator import MappedOperator
from airflow.sdk.definitions.taskgroup import TaskGroup

from airflow_deadline_batch.exceptions import ConfigurationError
from airflow_deadline_batch.operators.plan import DeadlineBatchOperator
from airflow_deadline_batch.operators.shard import DeadlineShardPodOperator, LocalShardOperator

START = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)

DAG_FILE = """
import datetime as dt

from airflow.sdk import DAG

from airflow_deadline_batch.operators.plan import DeadlineBatchOperator
from airflow_deadline_batch.operators.shard import DeadlineShardPodOperator, LocalShardOperator

with DAG("{name}", schedule=None, start_date=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)):
    plan = DeadlineBatchOperator(
        task_id="plan", input_uri="in.jsonl", output_uri="out", deadline="+1h", store_conn_id="store"
    )
    {operator}.partial(task_id="shard", {arguments}).expand_kwargs(plan.output)
"""

#: DAG file name -> (shard operator, its partial() arguments, what the import error must say or None)
CASES = {
    "good_pod": ("DeadlineShardPodOperator", "image='w', race_check_interval_s=10", None),
    "good_local": ("LocalShardOperator", "pools=[{'name': 'spot', 'kind': 'spot'}]", None),
    # the shard operator's own checks
    "race_interval": (
        "DeadlineShardPodOperator",
        "image='w', race_check_interval_s=0",
        "argument race_check_interval_s (race_check_interval_s must be > 0 and <= 86400 seconds, "
        "got 0: pass race=False to never race)",
    ),
    "pool_typo": (
        "LocalShardOperator",
        "pools=[{'name': 'spot', 'kind': 'spot', 'gpu': 2}]",
        "argument pools (pools[0] is no pool (unknown pool field(s) ['gpu']",
    ),
    "pool_name_only": (
        "DeadlineShardPodOperator",
        "image='w', pools=['spot']",
        "argument pools (pools[0] is no pool",
    ),
    # KubernetesPodOperator's
    "finish_action": (
        "DeadlineShardPodOperator",
        "image='w', on_finish_action='keep'",
        "argument on_finish_action ('keep' is not a valid OnFinishAction)",
    ),
    # BaseOperator's
    "timeout_as_seconds": (
        "LocalShardOperator",
        "execution_timeout=600",
        "argument execution_timeout (execution_timeout must be timedelta object",
    ),
    # a value given on partial() and by the plan's specs: Airflow's duplicate check at unmapping
    "mapped_twice": ("LocalShardOperator", "shard_index=0", "argument shard_index ("),
}


@pytest.fixture(scope="module")
def dagbag(tmp_path_factory: pytest.TempPathFactory):
    from airflow.dag_processing.dagbag import DagBag

    folder = tmp_path_factory.mktemp("dags")
    for name, (operator, arguments, _) in CASES.items():
        source = DAG_FILE.format(name=name, operator=operator, arguments=arguments)
        (folder / f"{name}.py").write_text(source)
    return DagBag(dag_folder=str(folder))


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_refused_partial_argument_is_an_import_error_naming_it(dagbag, name: str) -> None:
    operator, _, expected = CASES[name]
    errors = {Path(path).stem: error for path, error in dagbag.import_errors.items()}
    if expected is None:
        assert name not in errors and name in dagbag.dag_ids
        return
    assert name not in dagbag.dag_ids
    line = errors[name].strip().splitlines()[-1]
    assert line.startswith(
        f"airflow_deadline_batch.exceptions.ConfigurationError: shard task 'shard': {operator} "
    )
    assert f"refuses its partial() {expected}" in line
    assert line.endswith(
        "fix it in the DAG file (every mapped instance would fail on it in the worker, "
        "before running its shard)"
    )


def test_the_probe_leaves_the_dag_its_task_group_and_setup_teardown_as_they_were() -> None:
    """The probe is built with ``_airflow_from_mapped``: in no DAG, task group or setup/teardown
    scope; only the mapped task is there, linked to the plan, the setup and the teardown as any task."""
    with DAG("probed", schedule=None, start_date=START) as dag:
        plan = DeadlineBatchOperator(task_id="plan", input_uri="in", output_uri="out", deadline="+1h")
        setup = EmptyOperator(task_id="setup").as_setup()
        teardown = EmptyOperator(task_id="teardown").as_teardown(setups=setup)
        with TaskGroup("group") as group, setup >> teardown:
            shards = LocalShardOperator.partial(task_id="shard").expand_kwargs(plan.output)
            other = EmptyOperator(task_id="other")

    assert set(dag.task_dict) == {"plan", "setup", "teardown", "group.shard", "group.other"}
    assert isinstance(shards, MappedOperator) and dag.task_dict["group.shard"] is shards
    assert group.children == {"group.shard": shards, "group.other": other}
    # Airflow links the tasks built in the scope (the mapped task is not one of them); not the probe
    assert setup.downstream_task_ids == {"teardown", "group.other"}
    assert teardown.upstream_task_ids == {"setup", "group.other"}
    assert plan.downstream_task_ids == {"group.shard"}


def test_a_refused_argument_in_default_args_is_named_by_its_refusal() -> None:
    """No single partial() argument to blame (the DAG's default_args give it): the refusal says it."""
    with DAG("defaults", schedule=None, start_date=START, default_args={"race_check_interval_s": -1.0}):
        plan = DeadlineBatchOperator(task_id="plan", input_uri="in", output_uri="out", deadline="+1h")
        partial = DeadlineShardPodOperator.partial(task_id="shard", image="w")
        with pytest.raises(ConfigurationError) as raised:
            partial.expand_kwargs(plan.output)
    assert str(raised.value).startswith(
        "shard task 'shard': DeadlineShardPodOperator refuses its partial() arguments "
        "(race_check_interval_s must be > 0 and <= 86400 seconds, got -1.0"
    )


def test_a_constructor_check_refuses_a_malformed_pool_outside_a_dag_too() -> None:
    with pytest.raises(ValueError, match=r"^pools\[1\] is no pool \(pool name must not be empty\)"):
        LocalShardOperator(
            task_id="shard",
            job_id="j",
            shard_index=0,
            pools=[{"name": "a", "kind": "spot"}, {"name": "", "kind": "spot"}],
        )
    given = LocalShardOperator(
        task_id="shard", job_id="j", shard_index=0, pools=[{"name": "a", "kind": "spot"}]
    )
    assert given.pools == [{"name": "a", "kind": "spot"}]  # kept as given: the job's rates fill the rest
