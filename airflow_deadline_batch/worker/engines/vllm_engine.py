"""vLLM offline batch (``LLM.generate`` on token ids): the production engine in the worker image.

``vllm`` is imported only when this engine is selected, so the package works without it.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_deadline_batch.core.results import Choice, FinishReason, TokenLogprob, TopLogprob
from airflow_deadline_batch.exceptions import EngineError
from airflow_deadline_batch.worker.engines.base import (
    ENGINE_ERROR,
    PROMPT_TOO_LONG,
    Generation,
    GenerationParams,
    chat_turns,
    is_chat,
    refusal,
    text_digest,
    weights_digest,
)

if TYPE_CHECKING:
    from airflow_deadline_batch.core.records import Request

#: LLM(...) keyword options the worker passes through from ``--engine-option`` (typed here)
#: The least log probability written, as the OpenAI API does (-9999.0, "very unlikely"): vLLM
#: gives -inf for a token a logits processor or structured output masked, which JSON cannot carry
#: (orjson writes null, a result that no longer reads back), so the record would be lost.
LOGPROB_FLOOR = -9999.0

_LLM_OPTIONS: dict[str, type] = {
    "tensor_parallel_size": int,
    "gpu_memory_utilization": float,
    "max_model_len": int,
    "dtype": str,
    "quantization": str,
    "revision": str,
    "enforce_eager": lambda v: str(v).lower() in ("1", "true", "yes"),  # type: ignore[dict-item]
}


def _import_vllm() -> Any:
    try:
        return importlib.import_module("vllm")
    except ImportError as exc:
        raise EngineError(
            "the vllm engine needs vLLM; pip install 'airflow-deadline-batch[vllm]' "
            "(or use the worker image, which ships it)"
        ) from exc


class VllmEngine:
    """One ``LLM`` per process; one ``SamplingParams`` per request (its own max_tokens and seed)."""

    name = "vllm"

    def __init__(self, model: str, *, seed: int = 0, llm_options: dict[str, Any] | None = None) -> None:
        if not model:
            raise EngineError("the vllm engine needs --model (a local model directory in the image)")
        self.model = model
        self.seed = seed
        self.llm_options = dict(llm_options or {})
        self._llm: Any = None
        self._vllm: Any = None

    @property
    def model_name(self) -> str:
        return Path(self.model).name if Path(self.model).exists() else self.model

    @property
    def model_digest(self) -> str:
        path = Path(self.model)
        # a hub name cannot be hashed without downloading: its digest names it, weakly
        return weights_digest(path) if path.exists() else text_digest(f"vllm-hub:{self.model}")

    def load(self) -> None:
        if self._llm is not None:
            return
        self._vllm = _import_vllm()
        try:
            self._llm = self._vllm.LLM(model=self.model, seed=self.seed, **self.llm_options)
        except Exception as exc:  # vLLM raises many types at load; all mean "cannot load"
            raise EngineError(f"vLLM cannot load {self.model!r}: {exc}") from exc

    def generate(self, requests: Sequence[Request], params: GenerationParams) -> list[Generation]:
        self.load()
        tokenizer = self._llm.get_tokenizer()
        limit = self._max_model_len()
        results: list[Generation | None] = [None] * len(requests)
        prompts: list[dict[str, list[int]]] = []
        sampling: list[Any] = []
        positions: list[int] = []
        for pos, request in enumerate(requests):
            refused = refusal(request, self.name)
            if refused is not None:
                results[pos] = refused
                continue
            p = params.for_request(request)
            # the ids that will run: the context check counts exactly these, and vLLM adds nothing
            ids = prompt_token_ids(tokenizer, request)
            if limit is not None and len(ids) + p.max_tokens > limit:
                results[pos] = Generation.failed(
                    PROMPT_TOO_LONG,
                    f"prompt has {len(ids)} tokens; with max_tokens {p.max_tokens} it "
                    f"exceeds max_model_len {limit}",
                    prompt_tokens=len(ids),
                )
                continue
            prompts.append({"prompt_token_ids": ids})
            sampling.append(self._sampling_params(p))
            positions.append(pos)
        if prompts:
            outputs = self._llm.generate(prompts, sampling, use_tqdm=False)
            for pos, output in zip(positions, outputs, strict=True):
                results[pos] = _to_generation(output, params.for_request(requests[pos]))
        return [r for r in results if r is not None]

    def _sampling_params(self, p: GenerationParams) -> Any:
        """``SamplingParams`` of one request; every field the table (core.params) maps for vLLM."""
        kwargs: dict[str, Any] = {
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "seed": p.seed,
            "stop": list(p.stop) or None,
        }
        if p.presence_penalty:
            kwargs["presence_penalty"] = p.presence_penalty
        if p.frequency_penalty:
            kwargs["frequency_penalty"] = p.frequency_penalty
        if p.logit_bias:
            kwargs["logit_bias"] = dict(p.logit_bias)
        if p.n > 1:
            kwargs["n"] = p.n
        if p.logprobs:
            # vLLM returns the sampled token's log probability plus the k likeliest (k may be 0)
            kwargs["logprobs"] = p.top_logprobs
        structured = p.json_format()
        if structured is not None:
            kwargs.update(self._structured(*structured))
        return self._vllm.SamplingParams(**kwargs)

    def _structured(self, kind: str, schema: dict[str, Any] | None) -> dict[str, Any]:
        """Structured outputs: ``StructuredOutputsParams`` (vLLM >= 0.10.2), else the older
        ``GuidedDecodingParams``; both take ``json=schema`` or ``json_object=True``."""
        module = importlib.import_module("vllm.sampling_params")
        spec = {"json": schema} if kind == "json_schema" else {"json_object": True}
        if hasattr(module, "StructuredOutputsParams"):
            return {"structured_outputs": module.StructuredOutputsParams(**spec)}
        if hasattr(module, "GuidedDecodingParams"):
            return {"guided_decoding": module.GuidedDecodingParams(**spec)}
        raise EngineError("this vLLM has no structured outputs; use vLLM >= 0.6 for response_format")

    def _max_model_len(self) -> int | None:
        config = getattr(getattr(self._llm, "llm_engine", None), "model_config", None)
        value = getattr(config, "max_model_len", None)
        return int(value) if value else None


def prompt_token_ids(tokenizer: Any, request: Request) -> list[int]:
    """The token ids vLLM runs for ``request``.

    A chat is the chat template rendered and tokenized in one step: the template writes its own
    BOS, so no tokenizer special tokens are added (rendering to text and handing the text to
    ``LLM.generate`` would add a second BOS for Llama-3-style templates). A completion prompt is
    tokenized as vLLM tokenizes text: with the tokenizer's special tokens (one BOS).
    """
    if is_chat(request):
        turns = [t.as_dict() for t in chat_turns(request)]
        text = str(tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True))
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    prompt = str(getattr(request, "prompt", "") or "")
    return [int(t) for t in tokenizer.encode(prompt, add_special_tokens=True)]


def _to_generation(output: Any, params: GenerationParams) -> Generation:
    """Map a vLLM ``RequestOutput`` to a Generation (usage from token ids; the text exactly).

    Every ``CompletionOutput`` becomes a choice when the request asked for ``n > 1`` or log
    probabilities; ``finish_reason`` is vLLM's own (``stop`` / ``length``).
    """
    prompt_tokens = len(getattr(output, "prompt_token_ids", None) or [])
    completions = getattr(output, "outputs", None) or []
    if not completions:
        return Generation.failed(ENGINE_ERROR, "vLLM returned no completion", prompt_tokens)
    choices = tuple(_choice(k, c, params) for k, c in enumerate(completions))
    tokens = sum(len(c.token_ids or []) for c in completions)
    first = choices[0]
    listed = choices if params.n > 1 or params.logprobs else None
    return Generation(
        first.text, None, prompt_tokens, tokens, finish_reason=first.finish_reason, choices=listed
    )


def _choice(index: int, completion: Any, params: GenerationParams) -> Choice:
    reason = getattr(completion, "finish_reason", None)
    finish: FinishReason | None = reason if reason in ("stop", "length") else None
    logprobs = None
    if params.logprobs:
        # one {token_id: Logprob(logprob, rank, decoded_token)} per generated token
        positions = getattr(completion, "logprobs", None) or []
        logprobs = tuple(
            _token_logprob(token_id, alternatives, params.top_logprobs)
            for token_id, alternatives in zip(completion.token_ids or [], positions, strict=False)
        )
    return Choice(index=index, text=str(completion.text), finish_reason=finish, logprobs=logprobs)


def _token_logprob(token_id: int, alternatives: Mapping[int, Any], top: int) -> TokenLogprob:
    chosen = alternatives[token_id]
    # the k likeliest have ranks 1..k; the sampled token is there too, with its own rank
    ranked = sorted((a for a in alternatives.values() if a.rank is not None), key=lambda a: a.rank)
    best = [a for a in ranked if a.rank <= top][:top]
    return TokenLogprob(
        token=str(chosen.decoded_token or ""),
        logprob=max(float(chosen.logprob), LOGPROB_FLOOR),
        top_logprobs=tuple(
            TopLogprob(token=str(a.decoded_token or ""), logprob=max(float(a.logprob), LOGPROB_FLOOR))
            for a in best
        ),
    )


def build(model: str | None, options: dict[str, Any]) -> VllmEngine:
    llm_options = {
        k: conv(options[k]) for k, conv in _LLM_OPTIONS.items() if options.get(k) not in (None, "")
    }
    return VllmEngine(model or "", seed=int(options.get("seed", 0) or 0), llm_options=llm_options)


def check(model: str | None, options: dict[str, Any]) -> None:
    """vLLM importable (looked up, not imported: that takes seconds) and a model named."""
    if importlib.util.find_spec("vllm") is None:
        raise EngineError(
            "the vllm engine needs vLLM; pip install 'airflow-deadline-batch[vllm]' "
            "(or use the worker image, which ships it)"
        )
    build(model, options)
