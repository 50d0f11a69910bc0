"""Who may read a job: Airflow's own login and its auth manager's DAG permissions.

The user comes from Airflow's ``get_user`` dependency (``airflow.api_fastapi.core_api.security``):
a JWT as a Bearer token, else the UI's ``_token`` cookie, exactly as Airflow's REST API reads
them, so an anonymous request gets Airflow's 401 and a bad token its 403. Which DAG a job belongs
to is recorded on the job: ``DeadlineBatchOperator``'s default idempotency key
``{dag_id}/{run_id}/{task_id}`` (:func:`ui.model.planned_by`). Reading a job needs ``GET`` on that
DAG's runs (``is_authorized_dag(method="GET", access_entity=RUN, details=DagDetails(id=...))``,
what Airflow's own ``GET /dags/{dag_id}/dagRuns/{run_id}`` asks); a job planned otherwise (the
CLI, or a custom idempotency key) is readable only by users who may read the runs of every DAG.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from airflow.api_fastapi.auth.managers.models.base_user import BaseUser

    from airflow_deadline_batch.ui.model import DagRunRef

log = logging.getLogger(__name__)


def _team_name(dag_id: str) -> str | None:
    """The DAG's team (multi-team deployments), as Airflow's ``requires_access_dag`` passes it."""
    try:
        from airflow.models.dag import DagModel

        return DagModel.get_team_name(dag_id)
    except Exception:  # no such DAG row, or no team support: no team
        log.debug("no team for dag %s", dag_id, exc_info=True)
        return None


def may_read(user: BaseUser, owner: DagRunRef | None) -> bool:
    """Whether ``user`` may read a job planned by ``owner`` (None: by no DAG)."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails

    details = None if owner is None else DagDetails(id=owner.dag_id, team_name=_team_name(owner.dag_id))
    return bool(
        get_auth_manager().is_authorized_dag(
            method="GET", access_entity=DagAccessEntity.RUN, details=details, user=user
        )
    )
