"""The parameter table: every body parameter honoured or refused, per line (core.params)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import orjson
import pytest

from airflow_deadline_batch.core.params import (
    ENGINE_NAMES,
    PARAMETERS,
    check_generation_defaults,
    check_params,
    markdown_table,
)
from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.core.records import (
    ErrorCode,
    LineError,
    RawLine,
    Record,
    ValidationLimits,
    parse_line,
    quick_parse,
)
from airflow_deadline_batch.exceptions import ConfigurationError
from airflow_deadline_batch.service.planning import PlanRequest, analyze_input
from airflow_deadline_batch.worker.engines import ENGINES

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def line(url: str = CHAT, **params: Any) -> bytes:
    body: dict[str, Any] = {"model": "m", "max_tokens": 5}
    if url == CHAT:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    return orjson.dumps({"custom_id": "r1", "method": "POST", "url": url, "body": {**body, **params}})


def outcome(data: bytes, engine: str | None) -> Record | LineError | None:
    limits = ValidationLimits(engine=engine)
    parsed = parse_line(RawLine(2, 0, len(data) + 1, data), limits)
    quick = quick_parse(data, limits)
    # the planner's fast path never accepts what parse_line refuses
    assert quick is None or isinstance(parsed, Record)
    return parsed


def test_the_table_covers_every_engine_the_worker_knows() -> None:
    assert set(ENGINE_NAMES) == set(ENGINES)
    for rule in PARAMETERS.values():
        assert set(rule.engines) <= set(ENGINE_NAMES), rule.name
        assert rule.engines.keys() == set(ENGINE_NAMES) or rule.refused, rule.name


SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}


@pytest.mark.parametrize(
    ("params", "accepted_by"),
    [
        ({"temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": ["\n"]}, set(ENGINE_NAMES)),
        ({"presence_penalty": 0.5}, {"vllm", "openai", "echo"}),
        ({"frequency_penalty": -1}, {"vllm", "openai", "echo"}),
        ({"logit_bias": {"42": -100}}, {"vllm", "openai", "echo"}),
        ({"response_format": {"type": "json_object"}}, {"vllm", "openai", "echo"}),
        ({"response_format": SCHEMA}, {"vllm", "openai", "echo"}),
        ({"n": 2}, {"echo", "transformers", "vllm"}),
        ({"logprobs": True}, {"echo", "transformers", "vllm"}),
        ({"top_logprobs": 3}, {"echo", "transformers", "vllm"}),
        ({"tools": [{"type": "function"}]}, set()),
        ({"stream": True}, set()),
        ({"reasoning_effort": "low"}, {"openai"}),
        # neutral values ask for nothing: accepted everywhere
        (
            {"n": 1, "logprobs": False, "response_format": {"type": "text"}, "presence_penalty": 0},
            set(ENGINE_NAMES),
        ),
        ({"user": "u", "metadata": {"k": "v"}, "store": False, "tools": None}, set(ENGINE_NAMES)),
    ],
)
def test_each_engine_honours_or_refuses_per_line(params: dict[str, Any], accepted_by: set[str]) -> None:
    for engine in ENGINE_NAMES:
        result = outcome(line(**params), engine)
        if engine in accepted_by:
            assert isinstance(result, Record), (engine, result)
            assert dict(result.request.params) == {k: v for k, v in params.items()}
        else:
            assert isinstance(result, LineError), engine
            assert result.code is ErrorCode.UNSUPPORTED_PARAMETER
            assert result.id == "r1"
            assert any(f"body.{name}" in result.message for name in params)
            assert engine in result.message


def test_unknown_and_wrong_endpoint_parameters_are_refused_on_every_engine() -> None:
    for engine in (*ENGINE_NAMES, None):
        for data, name in (
            (line(frobnicate=1), "frobnicate"),
            (line(COMPLETIONS, response_format={"type": "json_object"}), "response_format"),
            (line(CHAT, prompt="also"), "prompt"),
            (line(COMPLETIONS, messages=[]), "messages"),
        ):
            result = outcome(data, engine)
            assert isinstance(result, LineError) and result.code is ErrorCode.UNSUPPORTED_PARAMETER
            assert f"body.{name}" in result.message


def test_completion_only_parameters() -> None:
    assert isinstance(outcome(line(COMPLETIONS, echo=False, best_of=1, suffix=""), "vllm"), Record)
    for params in ({"echo": True}, {"best_of": 3}, {"suffix": "end"}):
        result = outcome(line(COMPLETIONS, **params), "vllm")
        assert isinstance(result, LineError) and result.code is ErrorCode.UNSUPPORTED_PARAMETER


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": "hot"},
        {"temperature": 3},
        {"top_p": 0},
        {"seed": 1.5},
        {"stop": [1]},
        {"logit_bias": {"token": 1}},
        {"logit_bias": {"1": 101}},
        {"response_format": {"type": "xml"}},
        {"response_format": {"type": "json_schema"}},
        {"presence_penalty": True},
    ],
)
def test_invalid_values_are_invalid_records_even_without_an_engine(params: dict[str, Any]) -> None:
    for engine in ("vllm", None):
        result = outcome(line(**params), engine)
        assert isinstance(result, LineError) and result.code is ErrorCode.INVALID_RECORD
        assert f"body.{next(iter(params))}" in result.message


def test_no_engine_checks_names_and_values_only() -> None:
    assert isinstance(outcome(line(n=3, response_format=SCHEMA), None), Record)


def test_ordinary_parameters_keep_the_fast_path() -> None:
    data = line(temperature=0.2, seed=1, stop="\n")
    assert quick_parse(data, ValidationLimits(engine="transformers")) == ("r1", ("hi",), 5)


def test_generation_defaults_follow_the_same_rules() -> None:
    assert (
        check_generation_defaults({"max_tokens": 9, "temperature": 0.3, "stop": "\n"}, "transformers") is None
    )
    problem = check_generation_defaults({"presence_penalty": 0.5}, "transformers")
    assert problem is not None and problem.kind == "unsupported" and problem.name == "presence_penalty"
    assert "generation presence_penalty" in problem.message
    assert check_generation_defaults({"response_format": {"type": "json_object"}}, "vllm") is None
    problem = check_generation_defaults({"temperature": "hot"}, "vllm")
    assert problem is not None and problem.kind == "invalid"
    problem = check_generation_defaults({"nonsense": 1}, "vllm")
    assert problem is not None and problem.name == "nonsense"
    assert check_params({}, "chat", "vllm") is None


# ------------------------------------------------------------------------------------ planning


def _plan_request(tmp_path: Path, engine: str, **kwargs: Any) -> PlanRequest:
    return PlanRequest(
        input_uri=str(tmp_path / "input.jsonl"),
        deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1),
        output_uri=str(tmp_path / "out"),
        engine=engine,
        pools=default_local_pools("echo"),
        **kwargs,
    )


def test_the_planner_refuses_per_line_and_counts_by_code(tmp_path: Path) -> None:
    lines = [
        line(temperature=0.1),
        line(presence_penalty=0.5).replace(b'"r1"', b'"r2"'),
        line(stream=True).replace(b'"r1"', b'"r3"'),
        orjson.dumps({"id": "r4", "prompt": "native"}),
    ]
    (tmp_path / "input.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    for engine, refused in (("vllm", 1), ("transformers", 2)):
        analysis = analyze_input(_plan_request(tmp_path, engine, max_invalid_fraction=1.0))
        try:
            assert dict(analysis.errors_by_code) == {"unsupported_parameter": refused}
            assert analysis.work.records == 4 - refused
            spooled = [orjson.loads(x) for x in analysis.error_spool.read().splitlines()]
            assert {r["id"] for r in spooled} == ({"r2", "r3"} if refused == 2 else {"r3"})
            assert all(r["error"]["code"] == "unsupported_parameter" for r in spooled)
        finally:
            analysis.close()


def test_job_generation_defaults_are_refused_with_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="generation frequency_penalty .* transformers engine"):
        _plan_request(tmp_path, "transformers", generation={"frequency_penalty": 0.3})
    with pytest.raises(ConfigurationError, match="generation stream"):
        _plan_request(tmp_path, "vllm", generation={"stream": True})
    _plan_request(tmp_path, "vllm", generation={"max_tokens": 8, "frequency_penalty": 0.3, "seed": 2})


def test_the_docs_table_is_the_code_table() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "engines.md").read_text()
    start = doc.index("do not edit by hand -->\n") + len("do not edit by hand -->\n")
    assert doc[start : doc.index("<!-- end of parameter table -->")] == markdown_table()
