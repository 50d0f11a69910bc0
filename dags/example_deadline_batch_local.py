"""Example: a deadline-bound LLM batch on one laptop, with injected Spot-style preemptions.

Runs with the embedded defaults: a SQLite manifest store and a local output folder under
``$ADB_EXAMPLE_DIR`` (default ``$AIRFLOW_HOME/deadline_batch_example``, else a temporary folder),
shard workers as local subprocesses, and the ``echo`` engine. Set ``ADB_ENGINE=transformers`` to run
the real SmolLM2-135M model on CPU. Try it with ``airflow dags test example_deadline_batch_local``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import tempfile
from pathlib import Path

from airflow.sdk import DAG, AsyncCallback, DeadlineAlert, DeadlineReference, task

from airflow_deadline_batch.notifiers.deadline_risk import DeadlineRiskNotifier
from airflow_deadline_batch.operators.plan import DeadlineBatchOperator
from airflow_deadline_batch.operators.shard import DEADLINE_WEIGHT_RULE, LocalShardOperator
from airflow_deadline_batch.sensors.completeness import CompletenessSensor

HERE = Path(__file__).resolve().parent
WORK_DIR = Path(
    os.environ.get("ADB_EXAMPLE_DIR")
    or Path(os.environ.get("AIRFLOW_HOME") or tempfile.gettempdir()) / "deadline_batch_example"
)
STORE_URL = os.environ.get("ADB_STORE_URL") or f"sqlite:///{WORK_DIR / 'store.db'}"
#: try numbers whose worker gets SIGTERM (then SIGKILL) shortly after it starts; "" disables
PREEMPT_TRIES = [int(t) for t in os.environ.get("ADB_EXAMPLE_PREEMPT_TRIES", "1").split(",") if t.strip()]
#: one OpenMP thread per worker unless set: shard workers share the laptop's cores, and oversubscribed
#: OpenMP spin-waits slow CPU generation by an order of magnitude (measured: 28 s vs ~300 s a microbatch)
WORKER_ENV = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}

with DAG(
    dag_id="example_deadline_batch_local",
    schedule=None,
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
    catchup=False,
    tags=["deadline-batch", "example"],
    params={
        "input_uri": os.environ.get("ADB_EXAMPLE_INPUT") or str(HERE / "data" / "sample_reviews.jsonl"),
        "output_uri": str(WORK_DIR / "output"),
        "deadline": os.environ.get("ADB_EXAMPLE_DEADLINE", "+2h"),
        "engine": os.environ.get("ADB_ENGINE", "echo"),
    },
    default_args={"retries": 4, "retry_delay": dt.timedelta(seconds=1)},
    # The hard miss: Airflow's own deadline alert, 3 h after the run was queued.
    deadline=DeadlineAlert(
        reference=DeadlineReference.DAGRUN_QUEUED_AT,
        interval=dt.timedelta(hours=3),
        callback=AsyncCallback("airflow_deadline_batch.notifiers.deadline_risk.log_hard_deadline_miss"),
    ),
) as dag:
    # The predictive alert: wrap SlackNotifier / PagerdutyNotifier / SmtpNotifier here for on-call.
    at_risk = DeadlineRiskNotifier(threshold_s=600)

    plan = DeadlineBatchOperator(
        task_id="plan",
        input_uri="{{ params.input_uri }}",
        output_uri="{{ params.output_uri }}",
        deadline="{{ params.deadline }}",
        engine="{{ params.engine }}",
        store_url=STORE_URL,
        workers=2,
        microbatch_size=4,
        generation={"max_tokens": 32},
        risk_notifier=at_risk,
        retries=0,
    )
    shards = LocalShardOperator.partial(
        task_id="shard",
        store_url=STORE_URL,
        preempt_tries=PREEMPT_TRIES,
        preempt_after_s=0.2,
        grace_s=2.0,
        env=WORKER_ENV,
        weight_rule=DEADLINE_WEIGHT_RULE,  # the job due soonest first (docs/airflow.md)
    ).expand_kwargs(plan.output)
    done = CompletenessSensor(
        task_id="verify",
        job_id="{{ ti.xcom_pull(task_ids='plan', key='job_id') }}",
        store_url=STORE_URL,
        deferrable=True,
        poke_interval=1.0,
        timeout=3 * 3600,
        risk_notifier=at_risk,
        retries=0,
    )

    @task
    def summarise(manifest_uri: str) -> dict:
        """Downstream work sees only a published, verified manifest."""
        path = manifest_uri.removeprefix("file://")
        manifest = json.loads(Path(path).read_text())
        print(f"manifest {manifest_uri}: {manifest['outcomes']}")
        return {"manifest": manifest_uri, "outcomes": manifest["outcomes"]}

    plan >> shards >> done
    summarise(done.output)
