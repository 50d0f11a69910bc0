"""S3 through an Airflow AWS connection, never through the process environment.

The storage layer builds its S3 clients with ``storage.s3.make_client()`` (credentials from the
environment, as a pod with IRSA has them) unless a client is handed to ``S3Storage``. The shared
planner and finalizer open storages by URI without a client argument, so :func:`connection_s3`
routes the clients they make (``storage.s3.use_client``) to the one the Amazon provider's
``S3Hook`` builds from the connection, for the duration of a ``with`` block: credentials, region
and endpoint come from the connection and nothing is written to ``os.environ`` (a subprocess
started meanwhile inherits no credentials).

``worker_environment`` is the one place credentials are turned into environment variables: the
environment of a *local* worker subprocess (``LocalShardOperator``), the stand-in for a pod's
Secret or IRSA; it is passed to that child only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def connection_client(aws_conn_id: str) -> Any:
    """A boto3 S3 client from the Airflow connection ``aws_conn_id`` (the Amazon provider's hook).

    The package's timeouts and retries (``storage.s3.client_config``) are the base; a connection's
    own ``config_kwargs`` win over them.
    """
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    from airflow_deadline_batch.storage.s3 import client_config

    hook = S3Hook(aws_conn_id=aws_conn_id)
    return hook.get_client_type(region_name=hook.region_name, config=client_config().merge(hook.config))


@contextlib.contextmanager
def connection_s3(aws_conn_id: str | None) -> Iterator[Any]:
    """Within the block, every S3 client the package makes is the connection's (yields it).

    Without ``aws_conn_id`` nothing changes: clients come from the ambient credentials (an
    instance profile, IRSA, workload identity), which is how a deployment without static keys runs.
    """
    if not aws_conn_id:
        yield None
        return
    from airflow_deadline_batch.storage.s3 import use_client

    with use_client(connection_client(aws_conn_id)) as client:
        yield client


def worker_environment(aws_conn_id: str | None) -> dict[str, str]:
    """``AWS_*`` variables for a local worker *subprocess* from the connection (empty without one).

    Only for the child's environment (``env=`` of the launcher); never for ``os.environ``.
    """
    if not aws_conn_id:
        return {}
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    hook = S3Hook(aws_conn_id=aws_conn_id)
    creds = hook.get_credentials()
    env = {"AWS_ACCESS_KEY_ID": creds.access_key, "AWS_SECRET_ACCESS_KEY": creds.secret_key}
    if creds.token:
        env["AWS_SESSION_TOKEN"] = creds.token
    endpoint = hook.conn_config.get_service_endpoint_url("s3")
    if endpoint:
        env["AWS_ENDPOINT_URL"] = endpoint
    if hook.region_name:
        env["AWS_DEFAULT_REGION"] = hook.region_name
    return {k: v for k, v in env.items() if v}
