"""The planner's inlined token estimate agrees with core.estimate's."""

from __future__ import annotations

import random

from airflow_deadline_batch.core.estimate import estimate_texts_tokens
from airflow_deadline_batch.service.planning import _texts_tokens


def test_texts_tokens_match_estimate_texts_tokens() -> None:
    rng = random.Random(7)
    alphabet = "ab c\t\né€😀\u0100"
    items: list[str | tuple[str, ...]] = ["", "a", "abcd", "abcde", "é", "😀x"]
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(40)))
        items.append(text if rng.random() < 0.5 else tuple(text.split("\t")))
    assert _texts_tokens(items) == [estimate_texts_tokens(t) for t in items]
    assert _texts_tokens(["abcde", "é"]) == [3, 2]  # ceil(5 / 4) + 1; one non-ASCII char + 1
