"""``simulate`` through run_simulate: the --json contract (docs/design.md §8), table, plot, errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import orjson
import pytest

from airflow_deadline_batch.exceptions import ConfigurationError
from airflow_deadline_batch.sim.cli import add_simulate_parser, run_simulate
from airflow_deadline_batch.sim.traces import regime_switching

REQUIRED = {
    "trace",
    "policy",
    "mean_cost",
    "cost_vs_on_demand",
    "miss_rate",
    "spot_hours",
    "on_demand_hours",
    "preemptions",
    "redone_hours",
    "starts",
}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    trace = regime_switching(7, hours=100, gap_s=300)
    path = tmp_path / "synthetic_v100_1.json"
    path.write_bytes(orjson.dumps({"metadata": {"gap_seconds": 300}, "data": list(trace.capacity)}))
    return path


def test_json_lines_per_trace_and_policy(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(
        [
            "simulate",
            "--trace",
            str(trace_file),
            "--trace",
            str(trace_file),
            "--work-hours",
            "6",
            "--deadline-hours",
            "8",
            "--changeover-hours",
            "0.2",
            "--price-ratio",
            "3",
            "--starts",
            "4",
            "--seed",
            "1",
            "--json",
        ]
    )
    assert run_simulate(args) == 0
    lines = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 10
    assert [line["policy"] for line in lines[:5]] == [
        "on_demand",
        "greedy",
        "uniform_progress",
        "omniscient",
        "slack_aware",
    ]
    for line in lines:
        assert set(line) >= REQUIRED
        assert line["starts"] == 4
        assert line["trace"].endswith("synthetic_v100_1.json")
    on_demand = lines[0]
    assert on_demand["mean_cost"] == pytest.approx((6 + 0.2) * 3)
    assert on_demand["cost_vs_on_demand"] == pytest.approx(1.0)
    assert all(line["miss_rate"] == 0 for line in lines)


def test_table_and_plot(trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "img" / "progress.png"
    args = parse(
        [
            "simulate",
            "--trace",
            str(trace_file),
            "--work-hours",
            "4",
            "--deadline-hours",
            "6",
            "--start-hours",
            "0,10",
            "--policy",
            "slack_aware",
            "--plot",
            str(png),
        ]
    )
    assert run_simulate(args) == 0
    out = capsys.readouterr().out
    assert "slack_aware" in out and "mean cost" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--policy", "nope"], "unknown --policy"),
        (["--start-hours", "a,b"], "--start-hours"),
        (["--workers", "0"], "workers"),
        # mistyped sizes that ran for ever
        (["--starts", "99999999999"], "--starts must be 1 to 10000, got 99999999999"),
        (["--workers", "100000"], "--workers must be 1 to 1024, got 100000"),
        (["--shard-hours", "1e-12"], "is 4e\\+12 shards, at most 100000: raise --shard-hours"),
        (["--deadline-hours", "1e9"], "--deadline-hours must be at most 8760"),
        (["--plot", "."], "--plot . is a directory: give the PNG file to write"),
    ],
)
def test_user_errors_are_configuration_errors(trace_file: Path, extra: list[str], match: str) -> None:
    args = parse(
        ["simulate", "--trace", str(trace_file), "--work-hours", "4", "--deadline-hours", "6", *extra]
    )
    with pytest.raises(ConfigurationError, match=match):
        run_simulate(args)


def test_missing_trace_file_names_the_fix(tmp_path: Path) -> None:
    args = parse(
        ["simulate", "--trace", str(tmp_path / "absent.json"), "--work-hours", "4", "--deadline-hours", "6"]
    )
    with pytest.raises(ConfigurationError, match="does not exist; pass an existing --trace"):
        run_simulate(args)
