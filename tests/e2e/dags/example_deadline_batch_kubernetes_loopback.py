"""The airflow DAG ``dags/example_deadline_batch_kubernetes.py``, with what a test here must change.

The example's source is read and run here with these replacements, each asserted to match exactly
once (so the example cannot drift from what the test runs):

* ``engine="vllm"`` -> ``engine="echo"``: no GPU and no vLLM here; the echo engine answers each prompt.
* ``retry_delay`` 30 s -> 1 s, the shard pods' ``poll_interval`` 30 s -> 1 s and the sensor's
  ``poke_interval`` 60 s -> 1 s: the same path, on a test's clock.
* the shard pods get ``env_from`` the Secret ``deadline-batch-s3``: the stand-in for the service
  account's IRSA credentials (the loopback API has no service accounts) and the S3 endpoint.

Not changed, because a deployment configures them outside the DAG: the kubeconfig (connection
``kubernetes_default``, extra ``kube_config_path``), the namespace (``ADB_NAMESPACE``, default
``deadline-batch``), the bucket and the deadline (run conf ``{"bucket": ..., "deadline_hours": ...}``),
the store and S3 credentials
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
    (
        'service_account_name="deadline-batch-worker",',
        'service_account_name="deadline-batch-worker",\n'
        "        env_from=[__import__('kubernetes').client.V1EnvFromSource("
        "secret_ref=__import__('kubernetes').client.V1SecretEnvSource(name='deadline-batch-s3'))],",
    ),
)


run_derived(EXAMPLE, REPLACEMENTS, dag_file=__file__, into=globals())
