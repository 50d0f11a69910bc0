"""Engines facing a hostile backend: what one bad response does to its microbatch.

The OpenAI engine against a real loopback HTTP server that answers each record its own way; the
vLLM engine's mapping of log probabilities that JSON cannot carry.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from airflow_deadline_batch.core.records import Message, Request
from airflow_deadline_batch.core.results import Choice
from airflow_deadline_batch.worker.engines import GenerationParams, get_engine

#: a well-formed choice, for the bodies whose usage is what is wrong
CHOICE = b'"choices": [{"message": {"content": "x"}}]'
#: prompt -> the raw 200 response body the server answers it with
HOSTILE_BODIES: dict[str, bytes] = {
    "message is a string": b'{"choices": [{"message": "oops"}]}',
    "choices is an object": b'{"choices": {"0": {"message": {"content": "x"}}}}',
    "content is a list": b'{"choices": [{"message": {"content": [{"type": "text", "text": "x"}]}}]}',
    "usage is a word": b"{" + CHOICE + b', "usage": {"prompt_tokens": "many"}}',
    "usage is infinite": b"{" + CHOICE + b', "usage": {"completion_tokens": 1e999}}',
    "usage is a list": b"{" + CHOICE + b', "usage": [1, 2]}',
}
GOOD = "a good one"
CUT_SHORT = "cut short"


@pytest.fixture
def hostile_api() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            text = body["messages"][-1]["content"]
            data = HOSTILE_BODIES.get(text)
            if data is None:
                data = json.dumps({"choices": [{"message": {"content": f"ok:{text}"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            # a server that breaks off mid-response promises more bytes than it sends
            self.send_header("Content-Length", str(len(data) + (100 if text == CUT_SHORT else 0)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def chat(text: str) -> Request:
    return Request("chat", None, (Message("user", text),), None)


def test_a_malformed_openai_response_errors_its_record_only(hostile_api: str) -> None:
    engine = get_engine("openai", "m", base_url=hostile_api, attempts="1")
    prompts = [GOOD, *HOSTILE_BODIES]

    # before: the first malformed body raised out of generate and failed the whole microbatch
    out = engine.generate([chat(p) for p in prompts], GenerationParams())

    assert out[0].output == f"ok:{GOOD}" and out[0].error is None
    for prompt, gen in zip(prompts[1:], out[1:], strict=True):
        assert gen.output is None and gen.error is not None, prompt
        assert gen.error.code == "engine_error"
        assert "is not an OpenAI completion" in gen.error.message, (prompt, gen.error.message)


def test_a_response_cut_short_is_a_transient_failure_that_is_retried(hostile_api: str) -> None:
    engine = get_engine("openai", "m", base_url=hostile_api, attempts="2", max_wait_s="0.05")
    # before: http.client.IncompleteRead escaped unclassified (deterministic: it spent the budget)
    with pytest.raises(Exception) as caught:
        engine.generate([chat(CUT_SHORT)], GenerationParams())
    assert type(caught.value).__name__ == "EngineError"
    assert "kept failing" in str(caught.value) and "IncompleteRead" in str(caught.value)


# ------------------------------------------------------------------------------------- vLLM


def test_a_log_probability_of_minus_infinity_is_written_as_openais_floor() -> None:
    from airflow_deadline_batch.core.results import ResultRecord, Usage
    from airflow_deadline_batch.worker.engines.vllm_engine import LOGPROB_FLOOR, _token_logprob
    from tests.unit.test_engines import FakeLogprob

    # token 7 was sampled; a logits processor masked token 98 (vLLM's -inf)
    alternatives = {7: FakeLogprob(-0.5, 1, " a"), 98: FakeLogprob(-math.inf, 2, " b")}
    masked = {7: FakeLogprob(-math.inf, 1, " a")}

    ranked = _token_logprob(7, alternatives, 2)
    chosen = _token_logprob(7, masked, 0)

    assert [t.logprob for t in ranked.top_logprobs] == [-0.5, LOGPROB_FLOOR] and ranked.logprob == -0.5
    assert chosen.logprob == LOGPROB_FLOOR == -9999.0
    # and so the record reads back as written (before: -inf was written as null)
    choice = Choice(index=0, text=" a", logprobs=(ranked, chosen))
    record = ResultRecord.succeeded(
        line=1, id="r", output=" a", usage=Usage(), shard_id="00000", attempt_id="a-1", choices=(choice,)
    )
    assert ResultRecord.parse_line(record.to_json_bytes()) == record
