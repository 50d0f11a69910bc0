"""The worker's command line (docs/design.md §6), built in one place for a pod and a subprocess.

The store URL is normally left out: the worker reads it from ``ADB_STORE_URL`` (a Kubernetes
Secret in a pod, the environment of a local subprocess), so no credentials appear in ``ps`` or in
the pod spec.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "OPERATOR_OPTIONS",
    "POD_NAME_ENV",
    "WORKER_MODULE",
    "given_options",
    "worker_arguments",
    "worker_command",
]

#: the module run as ``python -m`` in a pod and in a local subprocess
WORKER_MODULE = "airflow_deadline_batch.worker"
#: the shard pod's name, set by the pod operator from the downward API (``metadata.name``): the
#: worker names its attempts after it, whatever hostname the pod has (``hostNetwork``: the node's)
POD_NAME_ENV = "ADB_POD_NAME"
#: the worker's options a shard operator sets itself, from its task and its try's decision: a shard
#: pod's ``worker_args`` must not give them (``--race`` would make every pod a racer, which exits 0
#: on a shard nobody holds: the task succeeds, the shard never runs; ``--worker-name`` would hide
#: a dead pod's attempts from the operator; ``--shard``/``--job`` would run another shard)
OPERATOR_OPTIONS = (
    "--job",
    "--shard",
    "--pool",
    "--lease-ttl",
    "--grace",
    "--worker-name",
    "--store",
    "--race",
)


def worker_arguments(
    job_id: str,
    shard_index: int,
    *,
    pool: str | None = None,
    lease_ttl_s: float = 60.0,
    grace_s: float = 30.0,
    worker_name: str | None = None,
    engine_options: Sequence[str] = (),
    store_url: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The arguments after ``python -m airflow_deadline_batch.worker``.

    ``engine_options`` are ``KEY=VALUE`` items (each becomes ``--engine-option``); ``extra`` is
    appended as it is.
    """
    argv = ["--job", job_id, "--shard", str(shard_index)]
    if pool:
        argv += ["--pool", pool]
    argv += ["--lease-ttl", f"{lease_ttl_s:g}", "--grace", f"{grace_s:g}"]
    if worker_name:
        argv += ["--worker-name", worker_name]
    for option in engine_options:
        argv += ["--engine-option", option]
    if store_url is not None:
        argv += ["--store", store_url]
    return [*argv, *extra]


def worker_command(python: str, arguments: Sequence[str]) -> list[str]:
    """The whole argv of a worker process: ``python -m airflow_deadline_batch.worker ARGUMENTS``."""
    return [python, "-m", WORKER_MODULE, *arguments]


def given_options(arguments: Sequence[str], options: Sequence[str] = OPERATOR_OPTIONS) -> list[str]:
    """Which of ``options`` ``arguments`` give, as the worker's ``argparse`` reads them: whole, with
    ``=``, or abbreviated to a prefix (``--worker N``, ``--r``), before any ``--``."""
    found: list[str] = []
    for argument in arguments:
        if argument == "--":
            break
        option = argument.split("=", 1)[0]
        if len(option) > 2 and option.startswith("--"):
            found += [o for o in options if o.startswith(option) and o not in found]
    return found
