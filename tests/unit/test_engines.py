"""Engines: echo determinism and per-record errors, the vLLM contract, the OpenAI HTTP engine."""

from __future__ import annotations

import json
import sys
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from airflow_deadline_batch.core.records import Message, Request
from airflow_deadline_batch.core.results import TokenLogprob, TopLogprob
from airflow_deadline_batch.exceptions import ConfigurationError, EngineError
from airflow_deadline_batch.worker.engines import Generation, GenerationParams, get_engine
from airflow_deadline_batch.worker.engines.echo import FAIL_MARKER


def chat(text: str, max_tokens: int | None = None, **params: Any) -> Request:
    return Request("chat", None, (Message("system", "be brief"), Message("user", text)), max_tokens, params)


def completion(text: str, max_tokens: int | None = None, **params: Any) -> Request:
    return Request("completion", text, None, max_tokens, params)


# --------------------------------------------------------------------------------------- params


def test_request_params_override_job_params() -> None:
    job = GenerationParams(max_tokens=64, temperature=0.0, seed=7, stop=("\n",))
    effective = job.for_request(chat("hi", max_tokens=5, temperature=0.5, top_p=0.9, stop="END", n=3))
    assert effective == GenerationParams(max_tokens=5, temperature=0.5, top_p=0.9, seed=7, stop=("END",), n=3)
    assert job.for_request(chat("hi")) == job


def test_params_from_mapping_ignores_other_keys_and_rejects_bad_values() -> None:
    assert GenerationParams.from_mapping({"max_tokens": 9, "seed": 3, "engine": "echo"}) == GenerationParams(
        max_tokens=9, seed=3
    )
    with pytest.raises(ValueError, match="temperature"):
        GenerationParams.from_mapping({"temperature": -1})
    with pytest.raises(ValueError):
        GenerationParams().for_request(chat("x", seed="not-a-number"))


def test_unknown_engine_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="choose one of"):
        get_engine("nope")


# ----------------------------------------------------------------------------------------- echo


def test_echo_is_deterministic_and_respects_max_tokens() -> None:
    engine = get_engine("echo")
    engine.load()
    requests = [chat("one two three four"), completion("alpha beta", max_tokens=2)]
    first = engine.generate(requests, GenerationParams(max_tokens=3))
    assert first == engine.generate(requests, GenerationParams(max_tokens=3))
    assert first == [
        Generation("echo: one two", None, prompt_tokens=4, completion_tokens=3, finish_reason="length"),
        Generation("echo: alpha", None, prompt_tokens=2, completion_tokens=2, finish_reason="length"),
    ]
    assert engine.model_digest == get_engine("echo", delay_s_per_record="0").model_digest
    assert len(engine.model_digest) == 64


def test_echo_fail_marker_errors_only_that_record() -> None:
    engine = get_engine("echo")
    out = engine.generate(
        [chat("fine"), chat(f"please {FAIL_MARKER}"), chat("also fine")], GenerationParams()
    )
    assert [g.ok for g in out] == [True, False, True]
    assert out[1].error is not None and out[1].error.code == "engine_error" and out[1].output is None


def test_echo_delay_option_reads_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADB_ECHO_DELAY_S", "0.25")
    assert get_engine("echo").delay_s_per_record == 0.25  # type: ignore[attr-defined]
    assert get_engine("echo", delay_s_per_record="0.5").delay_s_per_record == 0.5  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------------------- vllm


@dataclass
class FakeLogprob:
    """vLLM's ``Logprob``: one token's log probability, its rank and its text."""

    logprob: float
    rank: int | None
    decoded_token: str | None


@dataclass
class FakeCompletion:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[int, FakeLogprob]] | None = None


@dataclass
class FakeRequestOutput:
    prompt_token_ids: list[int]
    outputs: list[FakeCompletion]


@dataclass
class FakeSamplingParams:
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str] | None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    structured_outputs: Any = None
    n: int = 1
    logprobs: int | None = None


@dataclass
class FakeStructuredOutputsParams:
    json: Any = None
    json_object: bool | None = None


BOS = 0


class FakeTokenizer:
    """A Llama-3-like tokenizer: its chat template writes BOS, and so does ``encode`` by default."""

    def apply_chat_template(
        self, messages: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool
    ) -> str:
        assert not tokenize and add_generation_prompt
        return "<bos> " + "".join(f"<{m['role']}> {m['content']} " for m in messages) + "<assistant>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [BOS if w == "<bos>" else 1 + len(w) for w in text.split()]
        return [BOS, *ids] if add_special_tokens else ids


@dataclass
class FakeLLM:
    """Records what the engine passes; shaped like vLLM's ``LLM`` for the calls the engine makes."""

    kwargs: dict[str, Any]
    calls: list[tuple[list[dict[str, list[int]]], list[FakeSamplingParams]]] = field(default_factory=list)
    instances: Any = None

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.calls = []
        self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=32))
        FAKE_LLMS.append(self)

    def get_tokenizer(self) -> FakeTokenizer:
        return FakeTokenizer()

    def generate(
        self, prompts: list[dict[str, list[int]]], params: list[FakeSamplingParams], use_tqdm: bool
    ) -> list[FakeRequestOutput]:
        assert all(set(p) == {"prompt_token_ids"} for p in prompts)  # token ids: vLLM adds nothing
        self.calls.append((prompts, params))
        return [
            FakeRequestOutput(p["prompt_token_ids"], [_fake_completion(i, k, sp) for k in range(sp.n)])
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]


FAKE_LLMS: list[FakeLLM] = []


def _fake_completion(i: int, k: int, params: FakeSamplingParams) -> FakeCompletion:
    """Choice k of prompt i: tokens 7, 8, ... (" t7", " t8", ...); the sampled token ranks 2nd,
    after token 99, when log probabilities are asked for."""
    tokens = list(range(7, 7 + i + 2))
    text = "".join(f" t{t}" for t in tokens) + (f" #{k}" if k else "")
    logprobs = None
    if params.logprobs is not None:
        logprobs = [
            {
                t: FakeLogprob(-0.5, 2, f" t{t}"),
                99: FakeLogprob(-0.25, 1, " x"),
                98: FakeLogprob(-3.0, 3, " y"),
            }
            for t in tokens
        ]
    return FakeCompletion(text, tokens, "length" if i else "stop", logprobs)


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM  # type: ignore[attr-defined]
    module.SamplingParams = FakeSamplingParams  # type: ignore[attr-defined]
    submodule = types.ModuleType("vllm.sampling_params")
    submodule.StructuredOutputsParams = FakeStructuredOutputsParams  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", submodule)
    FAKE_LLMS.clear()
    yield


def test_vllm_engine_passes_params_per_request_and_maps_outputs(fake_vllm: None) -> None:
    engine = get_engine("vllm", "/models/m", seed="11", tensor_parallel_size="2", max_model_len="32")
    engine.load()
    (llm,) = FAKE_LLMS
    assert llm.kwargs == {"model": "/models/m", "seed": 11, "tensor_parallel_size": 2, "max_model_len": 32}
    job = GenerationParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=11, stop=("###",))
    long_prompt = " ".join(["w"] * 30)
    out = engine.generate(
        [chat("a b c"), completion("x y", max_tokens=3, seed=5), completion(long_prompt)], job
    )
    ((prompts, sampling),) = llm.calls
    # one BOS each: the chat template's own, or the tokenizer's for a completion
    assert [p["prompt_token_ids"].count(BOS) for p in prompts] == [1, 1]
    assert prompts[1] == {"prompt_token_ids": [BOS, 2, 2]}  # the too-long one is not sent
    assert sampling == [
        FakeSamplingParams(8, 0.7, 0.9, 11, ["###"]),
        FakeSamplingParams(3, 0.7, 0.9, 5, ["###"]),
    ]
    # the text exactly as generated (never stripped); usage from the ids that ran
    assert out[0] == Generation(
        " t7 t8",
        None,
        prompt_tokens=len(prompts[0]["prompt_token_ids"]),
        completion_tokens=2,
        finish_reason="stop",
    )
    assert out[1] == Generation(
        " t7 t8 t9", None, prompt_tokens=3, completion_tokens=3, finish_reason="length"
    )
    assert out[2].error is not None and out[2].error.code == "prompt_too_long"
    assert out[2].prompt_tokens == 31  # counted on the same ids that would run: BOS + 30 words


def test_vllm_engine_maps_every_supported_parameter(fake_vllm: None) -> None:
    engine = get_engine("vllm", "/models/m")
    schema = {"type": "object", "properties": {"label": {"enum": ["pos", "neg"]}}}
    requests = [
        chat(
            "a",
            max_tokens=4,
            presence_penalty=0.5,
            frequency_penalty=-0.25,
            logit_bias={"17": -100, "3": 2.5},
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        ),
        chat("b", max_tokens=4, response_format={"type": "json_object"}, n=1, logprobs=False),
        chat("c", max_tokens=4, response_format={"type": "text"}),
    ]
    out = engine.generate(requests, GenerationParams())
    assert all(g.ok for g in out)
    ((_, sampling),) = FAKE_LLMS[0].calls
    assert sampling[0] == FakeSamplingParams(
        4, 0.0, 1.0, 0, None, 0.5, -0.25, {3: 2.5, 17: -100.0}, FakeStructuredOutputsParams(json=schema)
    )
    assert sampling[1].structured_outputs == FakeStructuredOutputsParams(json_object=True)
    assert sampling[2].structured_outputs is None


def test_vllm_engine_maps_n_and_logprobs_into_choices(fake_vllm: None) -> None:
    engine = get_engine("vllm", "/models/m")
    several, with_logprobs, plain = engine.generate(
        [
            completion("a", max_tokens=4, n=3),
            chat("b", max_tokens=4, logprobs=True, top_logprobs=1),
            chat("c", max_tokens=4),
        ],
        GenerationParams(),
    )
    ((_, sampling),) = FAKE_LLMS[0].calls
    assert [(sp.n, sp.logprobs) for sp in sampling] == [(3, None), (1, 1), (1, None)]
    assert several.choices is not None and [c.text for c in several.choices] == [
        " t7 t8",
        " t7 t8 #1",
        " t7 t8 #2",
    ]
    assert several.output == " t7 t8" and several.completion_tokens == 6
    assert all(c.logprobs is None for c in several.choices)
    assert with_logprobs.choices is not None and len(with_logprobs.choices) == 1
    tokens = with_logprobs.choices[0].logprobs
    assert tokens is not None and [t.token for t in tokens] == [" t7", " t8", " t9"]
    assert tokens[0] == TokenLogprob(
        token=" t7", logprob=-0.5, top_logprobs=(TopLogprob(token=" x", logprob=-0.25),)
    )
    assert with_logprobs.finish_reason == "length"
    assert plain.choices is None


def test_vllm_engine_refuses_what_it_cannot_honour(fake_vllm: None) -> None:
    engine = get_engine("vllm", "/models/m")
    out = engine.generate(
        [chat("a", tools=[{"type": "function"}]), chat("b", stream=True), chat("c")],
        GenerationParams(max_tokens=4),
    )
    assert [g.error.code if g.error else None for g in out] == [
        "unsupported_parameter",
        "unsupported_parameter",
        None,
    ]
    assert out[0].error is not None and "body.tools" in out[0].error.message
    ((prompts, _),) = FAKE_LLMS[0].calls
    assert len(prompts) == 1


def test_echo_and_transformers_guard_refuse_unsupported_parameters() -> None:
    echo = get_engine("echo")
    out = echo.generate(
        [chat("x y z", tools=[{"type": "function"}]), chat("a b STOP c", stop="STOP")],
        GenerationParams(),
    )
    assert out[0].error is not None and out[0].error.code == "unsupported_parameter"
    assert out[1] == Generation(
        "echo: a b ", None, prompt_tokens=4, completion_tokens=3, finish_reason="stop"
    )


def test_vllm_engine_without_vllm_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(EngineError, match=r"pip install 'airflow-deadline-batch\[vllm\]'"):
        get_engine("vllm", "/models/m").load()


# --------------------------------------------------------------------------------------- openai


@dataclass
class LoopbackAPI:
    base_url: str
    bodies: list[tuple[str, dict[str, Any]]]
    fail_next: list[int]


@pytest.fixture
def openai_server() -> Iterator[LoopbackAPI]:
    bodies: list[tuple[str, dict[str, Any]]] = []
    fail_next: list[int] = []  # statuses to answer with before succeeding (to exercise retries)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                bodies.append((self.path, {**body, "_auth": self.headers.get("Authorization")}))
                status = fail_next.pop(0) if fail_next else 200
            if status != 200:
                return self._send(status, {"error": {"message": "try later"}})
            text = (body.get("messages") or [{}])[-1].get("content") or body.get("prompt") or ""
            if "reject me" in text:
                return self._send(400, {"error": {"message": "bad request body"}})
            usage = {"prompt_tokens": len(text.split()), "completion_tokens": 2}
            choice: dict[str, Any]
            if self.path == "/v1/chat/completions":
                choice = {"message": {"role": "assistant", "content": f"chat:{text}"}}
            elif self.path == "/v1/completions":
                choice = {"text": f"text:{text}"}
            else:
                return self._send(404, {"error": {"message": "no such path"}})
            self._send(200, {"choices": [choice], "usage": usage})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield LoopbackAPI(f"http://127.0.0.1:{server.server_address[1]}/v1", bodies, fail_next)
    finally:
        server.shutdown()
        server.server_close()


def test_openai_engine_chat_and_completion(
    openai_server: LoopbackAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADB_OPENAI_API_KEY", "sk-test")
    engine = get_engine("openai", "served-model", base_url=openai_server.base_url, timeout_s="5")
    job = GenerationParams(max_tokens=16, temperature=0.2, seed=4)
    out = engine.generate(
        [chat("hello there", max_tokens=3), completion("plain words"), chat("reject me")], job
    )
    assert out[0] == Generation("chat:hello there", None, prompt_tokens=2, completion_tokens=2)
    assert out[1] == Generation("text:plain words", None, prompt_tokens=2, completion_tokens=2)
    assert out[2].error is not None and out[2].error.code == "request_rejected"
    assert "HTTP 400: bad request body" in out[2].error.message
    by_text = {
        json.dumps(b.get("messages") or b.get("prompt")): (path, b) for path, b in openai_server.bodies
    }
    path, body = by_text[
        json.dumps([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}])
    ]
    assert path == "/v1/chat/completions"
    assert body == {
        "model": "served-model",
        "max_tokens": 3,
        "temperature": 0.2,
        "top_p": 1.0,
        "seed": 4,
        "messages": body["messages"],
        "_auth": "Bearer sk-test",
    }
    assert by_text[json.dumps("plain words")][0] == "/v1/completions"


def test_openai_engine_retries_transient_statuses(openai_server: LoopbackAPI) -> None:
    engine = get_engine("openai", "m", base_url=openai_server.base_url, attempts="3", max_wait_s="0.05")
    openai_server.fail_next.extend([429, 503])
    assert (
        engine.generate([completion("after retries")], GenerationParams())[0].output == "text:after retries"
    )
    assert len(openai_server.bodies) == 3


def test_openai_engine_gives_up_after_bounded_retries(openai_server: LoopbackAPI) -> None:
    engine = get_engine("openai", "m", base_url=openai_server.base_url, attempts="2", max_wait_s="0.05")
    openai_server.fail_next.extend([500, 502, 500])
    with pytest.raises(EngineError, match="kept failing"):
        engine.generate([completion("never")], GenerationParams())
    assert len(openai_server.bodies) == 2


def test_openai_engine_needs_a_base_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ADB_OPENAI_BASE_URL", raising=False)
    with pytest.raises(EngineError, match="ADB_OPENAI_BASE_URL"):
        get_engine("openai", "m")


def test_openai_engine_forwards_the_body_parameters(openai_server: LoopbackAPI) -> None:
    engine = get_engine("openai", "m", base_url=openai_server.base_url)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    job = GenerationParams(max_tokens=16, frequency_penalty=0.1)
    out = engine.generate(
        [chat("forward me", response_format=fmt, user="u1", logit_bias={"5": 1}), chat("no", n=3)], job
    )
    assert out[0].ok
    assert out[1].error is not None and out[1].error.code == "unsupported_parameter"
    ((_, body),) = openai_server.bodies
    assert body["response_format"] == fmt
    assert body["user"] == "u1"
    assert body["logit_bias"] == {"5": 1.0}
    assert body["frequency_penalty"] == 0.1


def test_new_params_merge_and_stay_hashable() -> None:
    job = GenerationParams.from_mapping({"presence_penalty": 0.5, "response_format": {"type": "text"}})
    p = job.for_request(chat("x", logit_bias={"9": 1, "2": -1}, response_format={"type": "json_object"}))
    assert p.presence_penalty == 0.5 and p.logit_bias == ((2, -1.0), (9, 1.0))
    assert p.json_format() == ("json_object", None) and job.json_format() is None
    assert len({p, job, p}) == 2
