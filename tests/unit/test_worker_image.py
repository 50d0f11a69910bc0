"""The worker image's build files follow the rules a GPU pod needs (no image can be built here).

Checked: the base is pinned by digest, the worker's Python dependencies are pinned from the
repository's constraints (and the pins are not stale), the build context sends only what the
Dockerfile copies (never ``.venv`` or ``.git``), and the container runs as a non-root user.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "worker_image" / "Dockerfile"
sys.path.insert(0, str(ROOT / "scripts"))

import worker_constraints  # noqa: E402


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; ``!`` re-includes (parents included)."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.rstrip("/")
        candidates = [path] + [str(p) for p in Path(path).parents if str(p) != "."]
        if any(fnmatch.fnmatch(c, pat) or fnmatch.fnmatch(c, pat.replace("**/", "")) for c in candidates):
            ignored = not negate
    return ignored


@pytest.fixture(scope="module")
def ignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_worker_constraints_are_generated_from_the_repository_pins() -> None:
    assert (ROOT / "worker_image" / "constraints.txt").read_text() == worker_constraints.render(), (
        "worker_image/constraints.txt is stale: run .venv/bin/python scripts/worker_constraints.py"
    )


def test_worker_constraints_pin_every_package_exactly() -> None:
    pins = worker_constraints.pins()
    body = [
        line
        for line in (ROOT / "worker_image" / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert body, "no pins"
    for line in body:
        name, version = line.split("==")
        assert pins[name] == version
    names = {line.split("==")[0] for line in body}
    assert {"sqlalchemy", "boto3", "psycopg", "orjson", "tenacity"} <= names
    assert not names & worker_constraints.BASE_IMAGE_OWNS


def test_base_image_is_pinned_by_digest() -> None:
    instructions = _instructions()
    (arg,) = [rest for word, rest in instructions if word == "ARG" and rest.startswith("VLLM_BASE=")]
    assert "@sha256:" in arg
    froms = [rest for word, rest in instructions if word == "FROM"]
    assert froms == ["${VLLM_BASE}"]


def test_every_pip_install_is_pinned_and_checked() -> None:
    runs = [rest for word, rest in _instructions() if word == "RUN" and "pip install" in rest]
    assert runs
    for run in runs:
        for command in run.split("&&"):
            argv = shlex.split(command)
            if "install" not in argv:
                continue
            assert "--constraint" in argv or "-c" in argv or "--no-deps" in argv, command
            targets = [a for a in argv[argv.index("install") + 1 :] if not a.startswith("-")]
            # the only requirement named is the package itself (its extras pinned by the constraints)
            assert all(t.startswith(".") or t.endswith(".txt") for t in targets), command
        assert "pip check" in run


def test_container_runs_as_a_numeric_non_root_user() -> None:
    users = [rest for word, rest in _instructions() if word == "USER"]
    assert users, "no USER: the worker would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0


def test_build_context_sends_only_what_the_dockerfile_copies(ignore_patterns: list[str]) -> None:
    copied = []
    for word, rest in _instructions():
        if word == "COPY":
            copied += [s for s in shlex.split(rest)[:-1] if not s.startswith("--")]
    assert copied
    for source in copied:
        assert (ROOT / source).exists(), source
        assert not _ignored(source, ignore_patterns), f"{source} is copied but .dockerignore drops it"
    for heavy in (
        ".venv",
        ".venv/lib/python3.11/site-packages/torch",
        ".git",
        "tests",
        "dags",
        ".deadline-batch",
    ):
        assert _ignored(heavy, ignore_patterns), f"{heavy} would be sent to the Docker daemon"
    assert _ignored("airflow_deadline_batch/__pycache__", ignore_patterns)
