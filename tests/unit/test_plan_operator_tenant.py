"""`DeadlineBatchOperator`'s tenant: the argument, else the owner, else `default`."""

from __future__ import annotations

import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_deadline_batch.operators.plan import DeadlineBatchOperator


def _op(**kwargs: object) -> DeadlineBatchOperator:
    return DeadlineBatchOperator(
        task_id="plan", input_uri="in.jsonl", deadline="+1h", output_uri="out", **kwargs
    )


@pytest.mark.parametrize(
    ("kwargs", "tenant"),
    [
        ({"tenant": "search"}, "search"),
        ({"owner": "Data-Team, ml"}, "data-team"),
        ({"owner": "not a name"}, "default"),
        ({"owner": ""}, "default"),
        ({}, "default"),  # no owner: Airflow's default owner ("airflow") is not a team
        ({"owner": "airflow"}, "default"),
    ],
)
def test_tenant_comes_from_the_argument_then_the_owner(kwargs: dict[str, object], tenant: str) -> None:
    assert _op(**kwargs).resolve_tenant() == tenant


def test_a_bad_tenant_argument_fails_the_task() -> None:
    with pytest.raises(AirflowFailException, match="not a valid name"):
        _op(tenant="Bad_Name").resolve_tenant()
