"""vLLM prompt building with a real (tiny, built here) Llama-3-style tokenizer: one BOS, no GPU."""

from __future__ import annotations

import pytest

from airflow_deadline_batch.core.records import Message, Request
from airflow_deadline_batch.worker.engines.vllm_engine import prompt_token_ids

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

BOS = "<|begin_of_text|>"
SPECIAL = [BOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama 3's template shape: it writes BOS itself
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def llama3_like_tokenizer() -> object:
    words = ["[UNK]", *SPECIAL, "system", "user", "assistant", "be", "brief", "hello", "there"]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL)
    # like Llama 3's tokenizer.json: plain encoding prepends BOS
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, words.index(BOS))]
    )
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, unk_token="[UNK]")
    fast.chat_template = TEMPLATE
    return fast


def test_a_chat_prompt_has_one_bos() -> None:
    tok = llama3_like_tokenizer()
    bos = tok.convert_tokens_to_ids(BOS)  # type: ignore[attr-defined]
    request = Request("chat", None, (Message("system", "be brief"), Message("user", "hello there")), 5)
    ids = prompt_token_ids(tok, request)
    assert ids.count(bos) == 1 and ids[0] == bos
    # what the old engine ran: the rendered text, tokenized again with special tokens (as
    # LLM.generate does with a text prompt): two BOS
    text = tok.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tok.encode(text).count(bos) == 2  # type: ignore[attr-defined]


def test_a_completion_prompt_has_one_bos() -> None:
    tok = llama3_like_tokenizer()
    bos = tok.convert_tokens_to_ids(BOS)  # type: ignore[attr-defined]
    ids = prompt_token_ids(tok, Request("completion", "hello there", None, 5))
    assert ids.count(bos) == 1 and ids[0] == bos and len(ids) == 3
