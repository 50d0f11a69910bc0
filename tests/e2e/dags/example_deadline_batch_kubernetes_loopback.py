"""The airflow DAG ``dags/example_deadline_batch_kubernetes.py``, with what a test here must change.

The example's source is read and run here with these replacements, each asserted to match exactly
once (so the example cannot drift from what the test runs):

* ``engine="vllm"`` -> ``engine="echo"``: no GPU and no vLLM here; the echo engine answers each prompt.
* ``retry_delay`` 30 s -> 1 s, the shard pods' ``poll_interval`` 30 s -> 1 s and the sensor's
  ``poke_interval`` 60 s -> 1 s: the same path, on a test's clock.
* the sensor's ``retries=0`` -> ``retries=10``: a workaround for an Airflow 3.3 scheduler race, not a
  provider change. When a deferred task resumes (here at the trigger's first poll) before the
  scheduler has processed the LocalExecutor's "success" event of the try that deferred, the event
  (same task-instance key) removes the *resumed* workload from the executor's running set, and the
  scheduler fails the running task ("Executor LocalExecutor reported that the task instance ...
  finished with state success, but the task instance's state attribute is running"); Airflow
  guards this only while the task is still ``scheduled``. On two loaded cores it hit about one run
  in two (and twice in a row), after the manifest was already published; each retry re-defers
  and publishes the same manifest again. The shards have retries (6) anyway.
* the shard pods get ``env_from`` the Secret ``deadline-batch-s3``: the stand-in for the service
  account's IRSA credentials (the loopback API has no service accounts) and the S3 endpoint.

Not changed, because a deployment configures them outside the DAG: the kubeconfig (connection
``kubernetes_default``, extra ``kube_config_path``), the namespace (``ADB_NAMESPACE``, default
``deadline-batch``), the bucket (run conf ``{"bucket": ...}``), the store and S3 credentials
(connections ``deadline_batch_store`` and ``aws_default``). The image is ignored by the loopback API.
"""

from __future__ import annotations

from pathlib import Path

from tests.e2e.derived_dag import run_derived

EXAMPLE = Path(__file__).resolve().parents[3] / "dags" / "example_deadline_batch_kubernetes.py"
REPLACEMENTS = (
    ('engine="vllm",', 'engine="echo",'),
    ('"retry_delay": dt.timedelta(seconds=30)', '"retry_delay": dt.timedelta(seconds=1)'),
    ("poll_interval=30,", "poll_interval=1,"),
    ("poke_interval=60,", "poke_interval=1,"),
    # a workaround for an Airflow 3.3 race, not a provider change: see the docstring
    (
        "expire_unfinished=True,\n        risk_notifier=at_risk,\n        retries=0,",
        "expire_unfinished=True,\n        risk_notifier=at_risk,\n        retries=10,",
    ),
    (
        'service_account_name="deadline-batch-worker",',
        'service_account_name="deadline-batch-worker",\n'
        "        env_from=[__import__('kubernetes').client.V1EnvFromSource("
        "secret_ref=__import__('kubernetes').client.V1SecretEnvSource(name='deadline-batch-s3'))],",
    ),
)


run_derived(EXAMPLE, REPLACEMENTS, dag_file=__file__, into=globals())
