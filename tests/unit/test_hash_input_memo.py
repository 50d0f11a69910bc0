"""``run`` hashes a local input for its default idempotency key, then plans it: read once, not twice.

``service.planning.hash_input`` remembers a local file's digest by path, size, inode and mtime
(planning's own test of "unchanged"); any rewrite is hashed afresh.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_deadline_batch.service import planning


@pytest.fixture
def opens(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The inputs ``hash_input`` opened (the real opener, counted)."""
    seen: list[str] = []
    real = planning._open_input

    def counted(uri: str):  # type: ignore[no-untyped-def]
        seen.append(uri)
        return real(uri)

    monkeypatch.setattr(planning, "_open_input", counted)
    monkeypatch.setattr(planning, "_WHOLE_HASHES", {})
    yield seen


def test_an_unchanged_local_input_is_read_once(tmp_path: Path, opens: list[str]) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": "x"}\n' * 1000)
    expected = hashlib.sha256(path.read_bytes()).hexdigest()
    assert planning.hash_input(str(path)) == expected
    assert planning.hash_input(str(path)) == expected
    assert opens == [str(path)]


def test_a_rewritten_input_is_hashed_again(tmp_path: Path, opens: list[str]) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": "x"}\n')
    first = planning.hash_input(str(path))
    # the same size, rewritten in place: only the modification time tells
    stat = path.stat()
    path.write_bytes(b'{"id": "b", "prompt": "y"}\n')
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    second = planning.hash_input(str(path))
    assert second != first and second == hashlib.sha256(path.read_bytes()).hexdigest()
    # replaced by another file of the same size and time: a new inode
    other = tmp_path / "other.jsonl"
    other.write_bytes(b'{"id": "c", "prompt": "z"}\n')
    os.utime(other, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    os.replace(other, path)
    assert planning.hash_input(str(path)) == hashlib.sha256(path.read_bytes()).hexdigest()
    assert len(opens) == 3


def test_only_a_few_digests_are_kept(tmp_path: Path, opens: list[str]) -> None:
    paths = []
    for i in range(planning._WHOLE_HASHES_KEPT + 3):
        path = tmp_path / f"in-{i}.jsonl"
        path.write_bytes(f'{{"id": "{i}", "prompt": "x"}}\n'.encode())
        planning.hash_input(str(path))
        paths.append(path)
    assert len(planning._WHOLE_HASHES) == planning._WHOLE_HASHES_KEPT
    planning.hash_input(str(paths[0]))  # the oldest was forgotten: read again
    assert opens.count(str(paths[0])) == 2
