"""An OpenAI-compatible HTTP endpoint (``/v1/chat/completions`` and ``/v1/completions``).

Uses the standard library's ``urllib`` so the worker image needs no HTTP client package.
"""

from __future__ import annotations

import http.client
import json
import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tenacity import (
    RetryError,
    retry,
    retry_if_exception_type,
    stop_after_attempt,
    wait_random_exponential,
)

from airflow_deadline_batch.exceptions import EngineError
from airflow_deadline_batch.worker.engines.base import (
    ENGINE_ERROR,
    REQUEST_REJECTED,
    Generation,
    GenerationParams,
    chat_turns,
    is_chat,
    option_float,
    refusal,
    text_digest,
)

if TYPE_CHECKING:
    from airflow_deadline_batch.core.records import Request

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_ATTEMPTS = 5


class TransientHTTPError(Exception):
    """A failure worth retrying: 429, 5xx, or the connection broke or timed out."""


@dataclass(frozen=True)
class HTTPResult:
    status: int
    body: dict[str, Any]


def post_json(url: str, payload: dict[str, Any], headers: dict[str, str], timeout_s: float) -> HTTPResult:
    """POST JSON; 2xx and 4xx (except 429) are results, everything else is TransientHTTPError."""
    data = json.dumps(payload).encode()
    req = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json", **headers}
    )
    try:
        # explicit timeout: urllib's default is none, and a half-open socket would hang the pod
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return HTTPResult(resp.status, _json_body(resp.read()))
    except urllib.error.HTTPError as exc:
        body = _json_body(exc.read())
        if exc.code == 429 or exc.code >= 500:
            raise TransientHTTPError(f"HTTP {exc.code} from {url}") from exc
        return HTTPResult(exc.code, body)
    except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as exc:
        # HTTPException: the server broke off mid-response (IncompleteRead, a garbled status line)
        raise TransientHTTPError(f"cannot reach {url}: {exc}") from exc


def _json_body(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw or b"{}")
    except ValueError:
        return {"error": {"message": raw[:200].decode("utf-8", "replace")}}
    return value if isinstance(value, dict) else {"value": value}


class OpenAIEngine:
    """Sends each request of a microbatch concurrently; a rejected request is an errored record."""

    name = "openai"

    def __init__(
        self,
        model: str,
        *,
        base_url: str,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        attempts: int = DEFAULT_ATTEMPTS,
        concurrency: int = 8,
        max_wait_s: float = 20.0,
    ) -> None:
        if not base_url:
            raise EngineError(
                "the openai engine needs a base URL: --engine-option base_url=... "
                "or env ADB_OPENAI_BASE_URL (for example http://host:8000/v1)"
            )
        if not model:
            raise EngineError("the openai engine needs --model (the served model name)")
        self.model = model
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.concurrency = max(1, concurrency)
        # bounded, jittered retries: 429/5xx/resets are usually a busy or restarting server, and
        # jitter keeps many workers from retrying in lockstep; beyond the bound the microbatch
        # fails transiently and the shard is retried by a later attempt
        self._post = retry(
            retry=retry_if_exception_type(TransientHTTPError),
            stop=stop_after_attempt(max(1, attempts)),
            wait=wait_random_exponential(multiplier=0.5, max=max_wait_s),
            reraise=False,
        )(post_json)

    @property
    def model_name(self) -> str:
        return self.model

    @property
    def model_digest(self) -> str:
        # remote weights cannot be hashed here: the digest names the served model
        return text_digest(f"openai:{self.model}")

    def load(self) -> None:
        """Nothing to load: the server holds the model."""

    def generate(self, requests: Sequence[Request], params: GenerationParams) -> list[Generation]:
        if not requests:
            return []
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(requests))) as pool:
            return list(pool.map(lambda r: self._one(r, params.for_request(r)), requests))

    def _one(self, request: Request, params: GenerationParams) -> Generation:
        refused = refusal(request, self.name)
        if refused is not None:
            return refused
        # the body's own parameters are forwarded as they are (core.params says which may be);
        # the effective sampling params (job defaults under the body's) are written over them
        payload: dict[str, Any] = {
            k: v for k, v in (getattr(request, "params", None) or {}).items() if v is not None
        }
        payload.update(
            model=self.model,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
        )
        if params.stop:
            payload["stop"] = list(params.stop)
        if params.presence_penalty:
            payload["presence_penalty"] = params.presence_penalty
        if params.frequency_penalty:
            payload["frequency_penalty"] = params.frequency_penalty
        if params.logit_bias:
            payload["logit_bias"] = {str(k): v for k, v in params.logit_bias}
        if params.response_format is not None:
            payload["response_format"] = json.loads(params.response_format)
        if is_chat(request):
            url = f"{self.base_url}/chat/completions"
            payload["messages"] = [t.as_dict() for t in chat_turns(request)]
        else:
            url = f"{self.base_url}/completions"
            payload["prompt"] = str(getattr(request, "prompt", "") or "")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            result = self._post(url, payload, headers, self.timeout_s)
        except RetryError as exc:
            raise EngineError(f"OpenAI endpoint kept failing: {exc.last_attempt.exception()}") from exc
        if result.status >= 400:
            error = result.body.get("error")
            message = error.get("message") if isinstance(error, dict) else error
            return Generation.failed(REQUEST_REJECTED, f"HTTP {result.status}: {message or 'rejected'}")
        return _to_generation(result.body, chat=is_chat(request))


def _to_generation(body: dict[str, Any], *, chat: bool) -> Generation:
    """The record's Generation from a 2xx body; a body of another shape errors this record only
    (it used to raise out of ``generate`` and fail the whole microbatch, try after try)."""
    try:
        return _parse_generation(body, chat=chat)
    except (AttributeError, IndexError, KeyError, OverflowError, TypeError, ValueError) as exc:
        return Generation.failed(
            ENGINE_ERROR,
            f"the endpoint's response is not an OpenAI completion ({type(exc).__name__}: {exc}); "
            "check that the endpoint is OpenAI-compatible",
        )


def _parse_generation(body: dict[str, Any], *, chat: bool) -> Generation:
    usage = body.get("usage") or {}
    prompt_tokens = int(usage.get("prompt_tokens") or 0)
    choices = body.get("choices") or []
    if not choices:
        return Generation.failed(ENGINE_ERROR, "the endpoint returned no choices", prompt_tokens)
    choice = choices[0]
    text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
    if text is None:
        return Generation.failed(ENGINE_ERROR, "the endpoint returned an empty choice", prompt_tokens)
    if not isinstance(text, str):
        raise TypeError(f"the choice's text is a {type(text).__name__}, not a string")
    return Generation(text, None, prompt_tokens, int(usage.get("completion_tokens") or 0))


def build(model: str | None, options: dict[str, Any]) -> OpenAIEngine:
    return OpenAIEngine(
        model or str(options.get("model") or ""),
        base_url=str(options.get("base_url") or os.environ.get("ADB_OPENAI_BASE_URL") or ""),
        api_key=os.environ.get("ADB_OPENAI_API_KEY") or None,
        timeout_s=option_float(options, "timeout_s", DEFAULT_TIMEOUT_S),
        attempts=int(options.get("attempts") or DEFAULT_ATTEMPTS),
        concurrency=int(options.get("concurrency") or 8),
        max_wait_s=option_float(options, "max_wait_s", 20.0),
    )


def check(model: str | None, options: dict[str, Any]) -> None:
    """The endpoint and model must be named (nothing is contacted here)."""
    build(model, options)
