"""Predictability (docs/simulator.md, *Ninth round*): the features, the Markov forecast, the models'
fit on a first half and score on the second, and the bootstrap, on synthetic traces whose answer is
known (a daily cycle: the hour of day helps; a Markov chain: nothing beats the chain's own fit)."""

from __future__ import annotations

import numpy as np
import pytest

from airflow_deadline_batch.sim import predictability as pr
from airflow_deadline_batch.sim import traces
from airflow_deadline_batch.sim.mdp import AgeRates
from airflow_deadline_batch.sim.online_bound import age_twin
from airflow_deadline_batch.sim.traces import Trace


def test_features_and_targets_on_a_hand_made_trace() -> None:
    # half-hour ticks: present 2, absent 3, present 1 (capacity 2 counts as present)
    s = pr.series(Trace("hand", 1800.0, (1, 1, 0, 0, 0, 2)))
    assert s.up.tolist() == [1, 1, 0, 0, 0, 1]
    assert s.age_h.tolist() == [0.5, 1.0, 0.5, 1.0, 1.5, 0.5]
    assert s.hour.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert s.weekday is None  # 3 hours: no day-of-week model
    # the past 6 h is the whole history so far
    assert s.past[6.0].tolist() == pytest.approx([1.0, 1.0, 2 / 3, 0.5, 0.4, 0.5])
    present, fraction = pr.targets(s.up, 2)
    assert present.tolist() == [0, 0, 0, 1]  # Spot at t + 2
    assert fraction.tolist() == [0.5, 0.0, 0.0, 0.5]  # over (t, t + 2]


def test_the_markov_forecast_is_the_fitted_chain_raised_to_the_horizon() -> None:
    s = pr.series(traces.markov(0.4, 0.6, 200.0, 600.0, seed=2))
    every = np.arange(len(s.up) - 5)
    present, fraction = pr.markov_forecast(s, np.arange(len(s.up)), every, 5)
    a, b = s.up[:-1], s.up[1:]
    p = np.sum((a == 1) & (b == 0)) / np.sum(a == 1)
    q = np.sum((a == 0) & (b == 1)) / np.sum(a == 0)
    step = np.array([[1 - q, q], [p, 1 - p]])
    powers = [np.linalg.matrix_power(step, k) for k in range(1, 6)]
    for t in (0, 17, 100):
        x = int(s.up[t])
        assert present[t] == pytest.approx(powers[-1][x, 1])
        assert fraction[t] == pytest.approx(np.mean([m[x, 1] for m in powers]))


def test_a_daily_cycle_is_found_by_the_hour_of_day_and_by_the_regression() -> None:
    s = pr.series(traces.diurnal_markov(1, 1000.0, up_to_down=0.3, down_to_up=0.3))
    scores = [pr.score(s, h) for h in (4.0, 12.0)]
    for sc in scores:
        for metric in ("logloss", "brier", "mae"):
            est, lo, hi = pr.bootstrap([sc], "hour", metric, "age")
            assert hi < 0.0, (sc.horizon_h, metric, est, lo, hi)  # beyond noise
            assert pr.bootstrap([sc], "logit", metric, "logit_age")[2] < 0.0
        assert sc.mean["hour"]["logloss"] < 0.95 * sc.mean["age"]["logloss"]  # and by much


def test_on_a_markov_trace_nothing_beats_the_markov_fit_beyond_noise() -> None:
    s = pr.series(traces.markov(0.2, 0.3, 1000.0, 300.0, seed=1))
    for h in pr.HORIZONS_H:
        sc = pr.score(s, h)
        assert "week" in sc.mean and "zones" not in sc.mean  # 1,000 h; no other zone
        for name in pr.MODELS:
            if name in sc.mean and name != "markov":
                for metric in ("logloss", "brier"):
                    est, lo, hi = pr.bootstrap([sc], name, metric, "markov")
                    assert hi > 0.0, (h, name, metric, est, lo, hi)


def test_zones_of_the_same_run_are_a_feature_and_other_runs_are_not() -> None:
    a = traces.markov(0.5, 0.5, 300.0, 300.0, seed=1, name="run/one/a.json")
    b = traces.markov(0.5, 0.5, 300.0, 300.0, seed=2, name="run/one/b.json")
    other = traces.markov(0.5, 0.5, 300.0, 300.0, seed=3, name="run/two/c.json")
    scores = pr.measure([a, b, other])
    assert [("zones" in sc.mean) for sc in scores] == [True] * 3 + [True] * 3 + [False] * 3
    assert pr.series(a, [b]).zones.tolist() == [float(c >= 1) for c in b.capacity]  # type: ignore[union-attr]


def test_bad_input_says_what_to_pass() -> None:
    with pytest.raises(ValueError, match="same tick and length"):
        pr.series(traces.markov(0.5, 0.5, 100.0, seed=1), [traces.markov(0.5, 0.5, 50.0, seed=2)])
    flat = pr.series(traces.constant(1, 10.0))
    with pytest.raises(ValueError, match="never changes state"):
        pr.markov_forecast(flat, np.arange(10), np.arange(5), 2)
    with pytest.raises(SystemExit, match="not a directory"):
        pr.main(["--traces", "/nonexistent/spot-traces"])


def test_on_a_semi_markov_twin_the_hidden_phase_helps_and_the_clock_does_not() -> None:
    # young spells (first hour's phase) end at 3/h, old ones at 0.05/h: the phase is the memory,
    # and the age only a noisy sign of it (a spell leaves its first phase at a random time)
    ages = AgeRates(((3.0, 0.05), (3.0, 0.05)), (0.0, 1.0))
    double, phases = age_twin(traces.constant(1, 1.0, 300.0), ages, 1000.0, seed=1)
    scores = pr.score_twin(double, phases)
    for sc in scores:
        assert "phase" in sc.mean and "zones" not in sc.mean
        for name, base in (("hour", "age"), ("logit", "logit_age")):
            assert pr.bootstrap([sc], name, "logloss", base)[2] > 0.0, (sc.horizon_h, name)
    one_hour = scores[0]
    assert one_hour.horizon_h == 1.0
    est, lo, hi = pr.bootstrap([one_hour], "phase", "logloss", "age")
    assert hi < 0.0 and est < -0.05  # beyond noise, and by much
