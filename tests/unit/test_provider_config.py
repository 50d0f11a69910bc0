"""The provider's ``[deadline_batch]`` options: declared to Airflow (``airflow config`` shows them
with their defaults), each once, every one the code reads, with the code's defaults."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import airflow_deadline_batch
from airflow_deadline_batch.config import DEFAULT_BATCH_DAG_ID, DEFAULT_PLAN_TASK_ID, OPTIONS, SECTION
from airflow_deadline_batch.core.failures import (
    MIN_RESUME_DELAY_S,
    SCHEDULER_LATENCY_S,
    parse_resume_delay,
    parse_scheduler_latency,
)
from airflow_deadline_batch.provider import get_provider_info

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(airflow_deadline_batch.__file__).parent
AIRFLOW = Path(sys.executable).parent / "airflow"


def _airflow(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The ``airflow`` CLI in a fresh home, with none of the section's options set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(f"AIRFLOW__{SECTION.upper()}__")}
    env.update(AIRFLOW_HOME=str(tmp_path), PYTHONPATH=str(ROOT), AIRFLOW__CORE__LOAD_EXAMPLES="False")
    return subprocess.run(
        [str(AIRFLOW), *args], capture_output=True, text=True, env=env, timeout=120, check=False
    )


def test_airflow_config_get_value_gives_each_option_s_default(tmp_path: Path) -> None:
    """Bug: ``airflow config get-value deadline_batch scheduler_latency_s`` printed nothing (the
    options were not declared). Now each option with a default gives it, and it is the code's."""
    expected = {
        "min_resume_delay_s": MIN_RESUME_DELAY_S,
        "scheduler_latency_s": SCHEDULER_LATENCY_S,
        "batch_dag_id": DEFAULT_BATCH_DAG_ID,
        "batch_plan_task_id": DEFAULT_PLAN_TASK_ID,
    }
    assert {o.key for o in OPTIONS if o.default is not None} == set(expected)
    values = {}
    for key in expected:
        done = _airflow(tmp_path, "config", "get-value", SECTION, key)
        assert done.returncode == 0, done.stderr
        values[key] = done.stdout.strip()
    assert parse_resume_delay(values.pop("min_resume_delay_s")) == MIN_RESUME_DELAY_S
    assert parse_scheduler_latency(values.pop("scheduler_latency_s")) == SCHEDULER_LATENCY_S
    assert values == {"batch_dag_id": DEFAULT_BATCH_DAG_ID, "batch_plan_task_id": DEFAULT_PLAN_TASK_ID}


def test_airflow_config_list_describes_every_option(tmp_path: Path) -> None:
    """Bug: the section was missing from ``airflow config list``. Now every option is there with its
    description, its example and its default (commented out where it has none)."""
    done = _airflow(
        tmp_path,
        *("config", "list", "--section", SECTION),
        *("--show-values", "--include-descriptions", "--include-examples"),
    )
    assert done.returncode == 0, done.stderr
    listed = done.stdout
    assert listed.startswith(f"[{SECTION}]\n")
    for option in OPTIONS:
        assert option.description.split("\n")[0] in listed
        if option.example is not None:
            assert f"# Example: {option.key} = {option.example}\n" in listed
        if option.default is None:
            assert f"\n# {option.key} = \n" in listed
        else:
            assert f"\n{option.key} = {option.default}\n" in listed


def test_each_option_is_declared_once_with_what_airflow_s_schema_needs() -> None:
    declared = get_provider_info()["config"]
    assert list(declared) == [SECTION]
    options = declared[SECTION]["options"]
    assert len(options) == len(OPTIONS)  # a key declared twice would be one entry
    for key, option in options.items():
        assert option["type"] in {"string", "float"}, key
        assert option["version_added"] == airflow_deadline_batch.__version__, key
        assert option["description"].strip(), key


def _options_read() -> set[str]:
    """Every ``[deadline_batch]`` key the package reads with Airflow's ``conf`` (``conf.get*``),
    directly or through a function whose parameter is the key (``_setting(env, key, default)``).
    A read whose key cannot be told fails the test, so a new way of reading cannot slip past."""
    keys: set[str] = set()

    def conf_reads(node: ast.AST) -> list[ast.Call]:
        return [
            call
            for call in ast.walk(node)
            if isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr.startswith("get")
            and len(call.args) >= 2
            and isinstance(call.args[0], ast.Constant)
            and call.args[0].value == SECTION
        ]

    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        wrappers: dict[str, int] = {}  # function name: the position of its key parameter
        for read in conf_reads(tree):
            if isinstance(read.args[1], ast.Constant):
                keys.add(read.args[1].value)
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef):
                continue
            parameters = [a.arg for a in function.args.args]
            for read in conf_reads(function):
                key = read.args[1]
                if isinstance(key, ast.Constant):
                    continue
                assert isinstance(key, ast.Name) and key.id in parameters, (
                    f"{path}:{read.lineno}: a [{SECTION}] read whose key this test cannot tell"
                )
                wrappers[function.name] = parameters.index(key.id)
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in wrappers:
                key = call.args[wrappers[call.func.id]]
                assert isinstance(key, ast.Constant), f"{path}:{call.lineno}: a key this test cannot tell"
                keys.add(key.value)
    return keys


def test_every_option_the_code_reads_is_declared_and_every_declared_one_is_read() -> None:
    """Bug: none of the options the code reads was declared. Now the declarations and the reads
    are the same set: a new read without a declaration fails here, as does a stale declaration."""
    read = _options_read()
    assert {"min_resume_delay_s", "scheduler_latency_s", "store_conn_id", "files_uri"} <= read
    assert read == set(get_provider_info()["config"][SECTION]["options"])
