"""Structured output checked before commit, several choices and log probabilities in the record format.

``response_format`` json_object / json_schema completions are validated by the worker for every
engine (``check_structured``); the echo engine returns the user message verbatim for such
requests, so these tests drive it to a conforming and a non-conforming completion.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from airflow_deadline_batch.core.records import Message, Record, Request
from airflow_deadline_batch.core.results import Choice, ResultRecord, TokenLogprob, TopLogprob, Usage
from airflow_deadline_batch.worker.engines import Generation, GenerationParams, get_engine
from airflow_deadline_batch.worker.engines.base import INVALID_STRUCTURED_OUTPUT, check_structured
from airflow_deadline_batch.worker.worker import generate_microbatch, result_records

SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "label",
        "schema": {
            "type": "object",
            "properties": {"label": {"enum": ["spam", "ham"]}, "score": {"type": "number"}},
            "required": ["label"],
        },
    },
}


def chat(text: str, max_tokens: int | None = None, **params: Any) -> Request:
    return Request("chat", None, (Message("user", text),), max_tokens, params)


def run(*requests: Request) -> list[ResultRecord]:
    """The worker's own path: generate a microbatch with echo, check it, build the result records."""
    records = [Record(i + 1, f"r{i}", r, 10) for i, r in enumerate(requests)]
    generations, rejected = generate_microbatch(get_engine("echo"), records, GenerationParams())
    return result_records(records, generations, rejected, shard_index=0, attempt_id="a-1")


def test_a_conforming_completion_succeeds_and_a_non_conforming_one_has_its_own_code() -> None:
    ok, wrong_value, not_json, object_ok, object_bad = run(
        chat('{"label": "spam", "score": 0.9}', response_format=SCHEMA),
        chat('{"label": "eggs"}', response_format=SCHEMA),
        chat("spam, definitely", response_format=SCHEMA),
        chat(' {"anything": [1, 2]} ', response_format={"type": "json_object"}),
        chat("[1, 2]", response_format={"type": "json_object"}),
    )
    assert ok.status == "succeeded" and ok.output == '{"label": "spam", "score": 0.9}'
    assert object_ok.status == "succeeded" and object_ok.output == ' {"anything": [1, 2]} '  # verbatim
    for bad, words in (
        (wrong_value, "at label: 'eggs' is not one of"),
        (not_json, "is not JSON"),
        (object_bad, "not an object"),
    ):
        assert bad.status == "errored" and bad.output is None
        assert bad.error is not None and bad.error.code == INVALID_STRUCTURED_OUTPUT
        assert words in bad.error.message
        assert bad.usage.completion_tokens > 0  # the tokens were spent


def test_a_completion_cut_by_max_tokens_is_not_valid_json() -> None:
    (cut,) = run(chat('{"label": "spam", "score": 1}', response_format=SCHEMA, max_tokens=2))
    assert cut.error is not None and cut.error.code == INVALID_STRUCTURED_OUTPUT


def test_every_choice_is_validated() -> None:
    params = GenerationParams().for_request(chat("x", response_format=SCHEMA))
    good = Choice(index=0, text='{"label": "ham"}')
    bad = Choice(index=1, text='{"label": 3}')
    gen = Generation(good.text, None, 1, 2, choices=(good, bad))
    checked = check_structured(gen, params)
    assert checked.error is not None and checked.error.message.startswith("choice 1:")
    assert check_structured(Generation(good.text, None, 1, 2, choices=(good,)), params).ok
    # free text is never checked
    assert check_structured(Generation("not json"), GenerationParams()).ok


def test_an_invalid_schema_is_reported_not_raised() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    checked = check_structured(
        Generation("{}"), GenerationParams().for_request(chat("x", response_format=fmt))
    )
    assert checked.error is not None and "schema is invalid" in checked.error.message


def test_echo_gives_n_choices_and_certain_logprobs() -> None:
    (rec,) = run(chat("a b c", n=2, logprobs=True, top_logprobs=1))
    assert rec.status == "succeeded" and rec.choices is not None and len(rec.choices) == 2
    assert [c.text for c in rec.choices] == [rec.output] * 2 == ["echo: a b c"] * 2
    assert rec.usage.completion_tokens == 8  # both choices' tokens
    first = rec.choices[0].logprobs
    assert first is not None and "".join(t.token for t in first) == rec.output
    assert all(
        t.logprob == 0.0 and t.top_logprobs == (TopLogprob(token=t.token, logprob=0.0),) for t in first
    )
    (plain,) = run(chat("a b c"))
    assert plain.choices is None and plain.finish_reason == "stop"


# ------------------------------------------------------------------------------ the record format


def test_new_fields_round_trip_and_old_records_keep_their_bytes() -> None:
    usage = Usage(prompt_tokens=1, completion_tokens=4)
    old = ResultRecord.succeeded(line=1, id="a", output="x", usage=usage, shard_id="00000", attempt_id="a-1")
    assert b"finish_reason" not in old.to_json_bytes() and b"choices" not in old.to_json_bytes()
    logprobs = (TokenLogprob(token="x", logprob=-0.25, top_logprobs=(TopLogprob(token="x", logprob=-0.25),)),)
    rec = ResultRecord.succeeded(
        line=1,
        id="a",
        output="x",
        usage=usage,
        shard_id="00000",
        attempt_id="a-1",
        finish_reason="length",
        choices=(
            Choice(index=0, text="x", finish_reason="length", logprobs=logprobs),
            Choice(index=1, text="y"),
        ),
    )
    data = rec.to_json_bytes()
    assert list(orjson.loads(data))[-2:] == ["finish_reason", "choices"]
    assert ResultRecord.parse_line(data) == rec
    # a record written before these fields existed still reads
    assert ResultRecord.parse_line(old.to_json_bytes()).finish_reason is None


@pytest.mark.parametrize(
    "choices",
    [
        (Choice(index=0, text="other"),),  # choices[0] must be the output
        (Choice(index=1, text="x"),),  # numbered from 0
        (),
    ],
)
def test_inconsistent_choices_are_refused(choices: tuple[Choice, ...]) -> None:
    with pytest.raises(ValueError):
        ResultRecord.succeeded(
            line=1, id="a", output="x", usage=Usage(), shard_id="00000", attempt_id="a-1", choices=choices
        )
