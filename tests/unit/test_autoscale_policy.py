"""The autoscaling policy (pure, injected clock): target tracking, windows, steps, cooldowns, bounds,
scale to zero and the seasonal forecast; hypothesis properties for the guarantees the module states.

The properties take as many examples as the loaded hypothesis profile says (tests/conftest.py: more in
CI), and every horizon they wait through is derived from the generated config (``settle_ticks``)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from batching.autoscale_policy import (
    DOWN,
    HOLD,
    UP,
    WAKE,
    WAKE_FORECAST_FRACTION,
    ZERO,
    Observation,
    PolicyState,
    ScalingConfig,
    SeasonalProfile,
    decide,
    recommend,
)

TICK = 1.0


def run(config: ScalingConfig, loads, start: int, t0: float = 0.0, demand=None, forecasts=None, standby=None):
    """Feed one load per tick (``standby``: the ready standbys per tick); returns the replica count
    after each decision and the decisions."""
    state = PolicyState.start(start, t0)
    counts, decisions = [], []
    for i, load in enumerate(loads):
        obs = Observation(t0 + i * TICK, load, forecasts[i] if forecasts else None, bool(demand and demand[i]), standby[i] if standby else 0)
        decision, state = decide(config, state, obs)
        counts.append(state.replicas)
        decisions.append(decision)
    return counts, decisions


def settle_ticks(config: ScalingConfig, start: int) -> int:
    """An upper bound on the ticks a steady load takes to move ``start`` replicas to their final count: the
    longer stabilization window (the start is held for the down window), then every step of the longest way
    there (down to the floor or up to the maximum), each after its cooldown."""
    down = math.ceil(max(0, start - config.floor) / config.max_step_down) * max(TICK, config.down_cooldown_s)
    up = math.ceil(max(0, config.max_replicas - start) / config.max_step_up) * max(TICK, config.up_cooldown_s)
    return math.ceil((max(config.scale_up_window_s, config.scale_down_window_s) + max(up, down)) / TICK) + 2


def changes(counts, start):
    """(tick, +1/-1) of every change of direction-bearing moves."""
    out, prev = [], start
    for i, c in enumerate(counts):
        if c != prev:
            out.append((i, 1 if c > prev else -1))
        prev = c
    return out


configs = st.builds(
    lambda lo, span, target, up_w, down_w, step_up, step_down, up_cd, down_cd, zero, factor: ScalingConfig(
        min_replicas=lo, max_replicas=max(1, lo) + span, target=target, scale_up_window_s=up_w, scale_down_window_s=down_w,
        max_step_up=step_up, max_step_down=step_down, up_cooldown_s=up_cd, down_cooldown_s=down_cd,
        scale_to_zero_after_s=zero, predictive=False, standby_down_factor=factor,
    ),
    st.integers(0, 4), st.integers(0, 8), st.floats(0.5, 50), st.sampled_from([0.0, 2.0, 5.0]), st.sampled_from([3.0, 10.0, 30.0]),
    st.integers(1, 4), st.integers(1, 3), st.sampled_from([0.0, 3.0]), st.sampled_from([0.0, 5.0, 15.0]),
    st.one_of(st.none(), st.sampled_from([20.0, 60.0])), st.sampled_from([0.25, 0.5, 1.0]),
)  # fmt: skip


# ---- examples -----------------------------------------------------------------------------------


def test_target_tracking_scales_to_load_over_target():
    config = ScalingConfig(min_replicas=1, max_replicas=10, target=8, scale_down_window_s=5, down_cooldown_s=0, max_step_up=10)
    counts, decisions = run(config, [40] * 3, start=1)
    assert counts[0] == 5 and decisions[0].action == UP  # ceil(40 / 8)
    assert decisions[0].inputs["load"] == 40 and decisions[0].inputs["reactive"] == 5


def test_within_tolerance_nothing_moves():
    config = ScalingConfig(min_replicas=1, max_replicas=10, target=10, tolerance=0.1)
    counts, _ = run(config, [31, 29, 32, 28], start=3)
    assert counts == [3, 3, 3, 3]


def test_scale_down_waits_for_its_window_then_steps():
    config = ScalingConfig(min_replicas=1, max_replicas=10, target=10, scale_down_window_s=5, max_step_down=1, down_cooldown_s=0)
    counts, _ = run(config, [10] * 12, start=4)
    assert counts[:6] == [4] * 6  # the count found at start holds for the window (t = 0..5)
    assert counts[6:9] == [3, 2, 1]  # then one step per decision
    assert counts[-1] == 1


def test_scale_down_steps_wait_their_cooldown():
    config = ScalingConfig(min_replicas=1, max_replicas=10, target=10, scale_down_window_s=2, max_step_down=1, down_cooldown_s=4)
    counts, decisions = run(config, [10] * 16, start=4)
    assert counts[:3] == [4] * 3 and counts[3:] == [3] * 4 + [2] * 4 + [1] * 5  # one step, then 4 s before the next
    assert "down cooldown (4s) not over" in decisions[4].reason


def test_bounds_and_steps():
    config = ScalingConfig(min_replicas=2, max_replicas=5, target=1, max_step_up=2)
    counts, decisions = run(config, [100, 100, 100], start=2)
    assert counts == [4, 5, 5]
    assert "bounded" in decisions[1].reason


def test_scale_to_zero_after_idle_and_wake_on_demand():
    config = ScalingConfig(min_replicas=1, max_replicas=4, target=5, scale_to_zero_after_s=10, scale_down_window_s=3, down_cooldown_s=0)
    loads = [3] * 3 + [0] * 15 + [0, 0]
    demand = [False] * 18 + [True, False]
    counts, decisions = run(config, loads, start=1, demand=demand)
    zero_at = next(i for i, d in enumerate(decisions) if d.action == ZERO)
    assert zero_at == 2 + 10  # last load at t=2, idle 10 s
    assert counts[zero_at] == 0 and counts[17] == 0
    assert decisions[18].action == WAKE and counts[18] == 1  # a held request brings one replica back at once


def test_predictive_adds_capacity_ahead_and_never_removes_what_load_needs():
    config = ScalingConfig(min_replicas=1, max_replicas=10, target=10, predictive=True)
    counts, decisions = run(config, [5, 5], start=1, forecasts=[45, None])
    assert counts[0] == 5 and decisions[0].inputs["predictive"] == 5
    off = ScalingConfig(min_replicas=1, max_replicas=10, target=10, predictive=False)
    assert run(off, [5], start=1, forecasts=[45])[0] == [1]
    low = run(config, [60], start=6, forecasts=[5])[0]
    assert low == [6]  # a low forecast never removes capacity the present load needs


def test_config_is_validated():
    with pytest.raises(ValueError, match="max_replicas"):
        ScalingConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="signal"):
        ScalingConfig(signal="cpu")
    with pytest.raises(ValueError, match="unknown autoscaling field"):
        ScalingConfig.from_dict({"min_replicas": 1, "maximum": 3})
    assert ScalingConfig.from_dict(ScalingConfig(max_replicas=3).as_dict()) == ScalingConfig(max_replicas=3)


# ---- properties -----------------------------------------------------------------------------------


@settings(deadline=None)
@given(config=configs, load=st.floats(0, 400), start=st.integers(0, 12), ticks=st.integers(20, 120))
def test_never_outside_the_bounds(config, load, start, ticks):
    counts, _ = run(config, [load] * ticks, start=start)
    for i, c in enumerate(counts):
        assert c <= config.max_replicas
        if c < config.min_replicas or (c == 0 and config.min_replicas == 0 and load > 0):
            # only scale to zero goes below min, and only without load
            assert c == 0 and load == 0 and (config.scale_to_zero_after_s is not None or config.min_replicas == 0 or i == 0), (i, c)


@settings(deadline=None)
@given(config=configs, load=st.floats(0.1, 400), start=st.integers(1, 12))
@example(  # found by a user's run (issue 28): eight 15 s down cooldowns after the 30 s window, 150 s in all
    config=ScalingConfig(min_replicas=0, max_replicas=9, target=1.0, scale_up_window_s=0.0, scale_down_window_s=30.0, max_step_up=1,
                         max_step_down=1, up_cooldown_s=0.0, down_cooldown_s=15.0, scale_to_zero_after_s=None, predictive=False),
    load=1.0, start=9,
)  # fmt: skip
def test_no_oscillation_under_steady_load(config, load, start):
    """Constant load: the count moves one way only (toward its target), then stays."""
    settled = settle_ticks(config, start)
    counts, _ = run(config, [load] * (settled + 20), start=start)
    directions = {d for _, d in changes(counts, start)}
    assert len(directions) <= 1, counts
    assert set(counts[settled:]) == {counts[-1]}, (settled, counts)  # settled within the derived horizon


@settings(deadline=None)
@given(config=configs, before=st.floats(0.1, 200), after=st.floats(0.1, 200))
def test_no_oscillation_after_a_step(config, before, after):
    """Settled at one load, then a step to another: after the step the count moves one way only."""
    start = config.floor or 1
    settle = settle_ticks(config, start) + 30
    counts, _ = run(config, [before] * settle + [after] * (settle_ticks(config, config.max_replicas) + 20), start=start)
    assert counts[settle - 1] == counts[settle - 30]  # settled before the step
    tail = counts[settle - 1 :]
    directions = {d for _, d in changes(tail[1:], tail[0])}
    assert len(directions) <= 1, tail


@settings(deadline=None)
@given(config=configs, noise=st.lists(st.floats(0, 300), min_size=60, max_size=200))
def test_a_scale_down_never_follows_a_scale_up_within_the_down_window(config, noise):
    """Whatever the load does, the count cannot flap faster than the scale-down window (or the idle
    time to zero, whichever is shorter)."""
    counts, decisions = run(config, noise, start=config.floor or 1)
    window = config.scale_down_window_s
    if config.scale_to_zero_after_s is not None:
        window = min(window, config.scale_to_zero_after_s)
    last_up = -math.inf
    for i, d in enumerate(decisions):
        if d.replicas > d.previous:
            last_up = i * TICK
        elif d.replicas < d.previous:
            assert i * TICK - last_up > window - 1e-9 or d.previous > config.max_replicas, (i, last_up, counts)


@settings(deadline=None)
@given(config=configs, noise=st.lists(st.tuples(st.floats(0, 300), st.integers(0, 2)), min_size=60, max_size=200))
def test_with_a_standby_ready_a_scale_down_never_follows_a_scale_up_within_its_shorter_window(config, noise):
    """A ready standby shortens the window to ``standby_down_factor`` of it, never below: whatever the
    load and the standbys do, a scale-down comes no sooner after a scale-up than the window of its tick."""
    counts, decisions = run(config, [load for load, _ in noise], start=config.floor or 1, standby=[n for _, n in noise])
    last_up = -math.inf
    for i, (d, (_, ready)) in enumerate(zip(decisions, noise)):
        window = config.scale_down_window_s * (config.standby_down_factor if ready else 1.0)
        if config.scale_to_zero_after_s is not None:
            window = min(window, config.scale_to_zero_after_s)
        if d.replicas > d.previous:
            last_up = i * TICK
        elif d.replicas < d.previous:
            assert i * TICK - last_up > window - 1e-9 or d.previous > config.max_replicas, (i, last_up, counts)


@settings(deadline=None)
@given(config=configs, noise=st.lists(st.floats(0, 300), min_size=20, max_size=80), ready=st.integers(1, 3))
def test_a_ready_standby_changes_nothing_with_a_factor_of_one_and_no_standby_changes_nothing_at_all(config, noise, ready):
    """The factor acts only while a standby is ready: with none the config's factor is irrelevant, and a
    factor of 1 makes a ready standby irrelevant."""
    plain = replace(config, standby_down_factor=1.0)
    counts, _ = run(plain, noise, start=config.floor or 1)
    assert run(config, noise, start=config.floor or 1)[0] == counts
    assert run(plain, noise, start=config.floor or 1, standby=[ready] * len(noise))[0] == counts


def test_a_ready_standby_shortens_the_down_window_and_cooldown():
    config = ScalingConfig(min_replicas=1, max_replicas=10, target=10, scale_down_window_s=8, max_step_down=1, down_cooldown_s=4)
    loads = [40] + [10] * 20
    counts, _ = run(config, loads, start=1)  # no standby: the 8 s window, then a step every 4 s
    assert counts[:9] == [4] * 9 and counts[9:18] == [3] * 4 + [2] * 4 + [1] and counts[-1] == 1
    counts, decisions = run(config, loads, start=1, standby=[1] * len(loads))  # one ready: a quarter of each (2 s, 1 s)
    assert counts[:8] == [4, 4, 4, 3, 2, 1, 1, 1]
    assert decisions[3].reason == "highest recommendation in the last 2s is 1 (a standby is ready)" and decisions[3].inputs["standby"] == 1
    half = replace(config, standby_down_factor=0.5)  # 4 s, 2 s; the standby gone after the first step: the full 8 s and 4 s
    counts, decisions = run(half, loads, start=1, standby=[1] * 6 + [0] * 15)
    assert counts[:10] == [4] * 5 + [3] * 4 + [2]
    assert decisions[6].reason == "recommendation 1 not yet stable for 8s"
    counts, decisions = run(half, loads, start=1, standby=[1] * len(loads))
    assert counts[:9] == [4] * 5 + [3, 3, 2, 2] and "down cooldown (2s) not over" in decisions[6].reason


@pytest.mark.parametrize("factor", [0.0, -0.5, 1.5])
def test_a_standby_down_factor_outside_zero_to_one_is_refused(factor):
    with pytest.raises(ValueError, match=rf"^standby_down_factor must be in \(0, 1\] \(got {factor}\)$"):
        ScalingConfig(standby_down_factor=factor)
    assert ScalingConfig(standby_down_factor=1.0).standby_down_factor == 1.0


@settings(deadline=None)
@given(config=configs, base=st.floats(0, 20), spike=st.floats(20, 400))
def test_reacts_to_a_sustained_spike_within_its_window(config, base, spike):
    """A spike that lasts reaches the count it needs (or max) within the up window plus the steps it takes."""
    start = config.floor or 1
    settle = settle_ticks(config, start) + 30
    counts, _ = run(config, [base] * settle + [spike] * (settle_ticks(config, 0) + 1), start=start)
    before = counts[settle - 1]
    # the fewest replicas the policy accepts for this load (within its tolerance of the target)
    need = min(config.max_replicas, max(config.floor, math.ceil(spike / (config.target * (1 + config.tolerance)) - 1e-9)))
    if need <= before:
        return
    full = math.ceil(spike / config.target - 1e-9)
    steps = math.ceil((min(full, config.max_replicas) - max(before, 1)) / config.max_step_up) + (1 if before == 0 else 0)
    budget = config.scale_up_window_s + steps * max(TICK, config.up_cooldown_s) + TICK
    reached = next((i for i, c in enumerate(counts[settle:]) if c >= need), None)
    assert reached is not None and reached * TICK <= budget, (counts[settle - 1 : settle + 40], need, budget)


# ---- the seasonal profile ---------------------------------------------------------------------------


def test_profile_learns_a_daily_shape_and_forecasts_ahead():
    day, slot = 24.0, 1.0  # a compressed "day" of 24 one-second slots
    profile = SeasonalProfile(period_s=day, slot_s=slot, alpha=0.5)
    shape = lambda t: 10.0 + 90.0 * (1 <= (t % day) // 6 <= 2)  # noqa: E731 - high from 6 to 18
    for i in range(int(3 * day * 10)):
        t = i / 10
        profile.observe(t, shape(t))
    assert profile.forecast(3 * day + 0.5) == pytest.approx(10.0)
    assert profile.forecast(3 * day + 8.5) == pytest.approx(100.0)
    assert 10 < profile.forecast(3 * day + 6.0) < 100  # between slot centers: interpolated


def test_profile_knows_nothing_before_it_saw_a_slot():
    profile = SeasonalProfile(period_s=10, slot_s=1)
    assert profile.forecast(3.5) is None
    profile.seed([(0.2, 4.0), (0.8, 6.0), (1.5, 2.0)])
    assert profile.forecast(0.5) == pytest.approx(5.0)
    assert profile.means[1] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        SeasonalProfile(period_s=10, slot_s=3)


# ---- every decision's reason, the config's checks and the seasonal history (the mutation pass) ----------


def _decisions(config, steps, replicas):
    state = PolicyState.start(replicas, 0.0)
    out = []
    for now, *obs in steps:
        decision, state = decide(config, state, Observation(now, *obs))
        out.append((decision.replicas, decision.action, decision.reason))
    return out


def test_each_decision_says_why_in_full():
    config = ScalingConfig(
        min_replicas=0, max_replicas=6, target=10, scale_to_zero_after_s=100, up_cooldown_s=5, down_cooldown_s=20,
        scale_down_window_s=30, max_step_up=2,
    )  # fmt: skip
    steps = [(0, 25), (1, 60), (10, 60), (11, 60), (50, 5), (70, 5), (100, 0), (250, 0), (251, 0), (252, 3), (253, 0, None, True)]
    assert _decisions(config, steps, replicas=1) == [
        (3, "up", "load 25 > 1 x 10"),
        (3, "hold", "load 60 > 3 x 10; up cooldown (5s) not over"),
        (5, "up", "load 60 > 3 x 10"),
        (5, "hold", "load 60 > 5 x 10; up cooldown (5s) not over"),
        (4, "down", "highest recommendation in the last 30s is 1"),
        (3, "down", "highest recommendation in the last 30s is 1"),
        (2, "down", "highest recommendation in the last 30s is 1"),
        (0, "zero", "no load nor forecast for 180s (scale to zero after 100s)"),
        (0, "hold", "idle at zero replicas"),
        (1, "wake", "load 3 at zero replicas: wake to 1"),
        (1, "hold", "recommendation 0 not yet stable for 30s"),
    ]


def test_a_held_request_wakes_a_sleeping_endpoint_and_the_bounds_are_named():
    config = ScalingConfig(min_replicas=0, max_replicas=6, target=10, scale_to_zero_after_s=100, max_step_up=2)
    assert _decisions(config, [(1, 0, None, True)], replicas=0) == [(1, "wake", "load 0 and a held request at zero replicas: wake to 1")]
    assert _decisions(config, [(1, 200)], replicas=5) == [(6, "up", "load 200 > 5 x 10; bounded to [1, 6]")]


def test_a_forecast_scales_ahead_and_says_so():
    config = ScalingConfig(min_replicas=1, max_replicas=8, target=10)
    decision, _ = decide(config, PolicyState.start(1, 0.0), Observation(1, 5, 35))
    assert (decision.replicas, decision.action, decision.reason) == (4, "up", "load 5 > 1 x 10 (forecast 35)")
    assert decision.inputs == {
        "load": 5, "forecast": 35, "target": 10, "signal": "inflight", "per_replica": 5.0, "reactive": 1, "predictive": 4,
        "recommendation": 4, "demand": False, "idle_s": None, "standby": 0, "up_recommendation": 4, "down_recommendation": 4,
    }  # fmt: skip
    assert recommend(ScalingConfig(max_replicas=9, target=10), 2, 22, None) == (3, 3, None)
    assert recommend(ScalingConfig(max_replicas=9, target=10), 2, 23, 45) == (5, 3, 5)
    assert recommend(ScalingConfig(max_replicas=9, target=10, predictive=False), 2, 0, 45) == (0, 0, None)


def test_a_config_lists_every_problem_at_once():
    with pytest.raises(ValueError) as err:
        ScalingConfig(
            min_replicas=-1, max_replicas=0, target=0, signal="x", unit="y", tolerance=1, scale_up_window_s=-1, max_step_up=0,
            scale_to_zero_after_s=0, cold_start_budget_s=0,
        )  # fmt: skip
    assert str(err.value) == (
        "min_replicas must be >= 0 (got -1); max_replicas must be >= max(1, min_replicas) (got 0, min -1); "
        "target must be a positive number (got 0); unit must be one of replicas, instances (got 'y'); "
        "signal must be one of inflight, queue, qps, tokens_per_s, triton_queue_ms (got 'x'); tolerance must be in [0, 1) (got 1); "
        "scale_up_window_s must be >= 0 (got -1); max_step_up and max_step_down must be >= 1; "
        "scale_to_zero_after_s must be > 0 (got 0); cold_start_budget_s must be > 0 (got 0)"
    )
    with pytest.raises(ValueError, match="^unknown autoscaling field\\(s\\): alpha, bogus$"):
        ScalingConfig.from_dict({"max_replicas": 2, "bogus": 1, "alpha": 2})
    config = ScalingConfig(min_replicas=2, max_replicas=8, target=3.0, unit="instances")
    assert ScalingConfig.from_dict(config.as_dict()) == config
    assert (config.floor, ScalingConfig(min_replicas=0, max_replicas=2).floor, ScalingConfig(min_replicas=0, max_replicas=2, scale_to_zero_after_s=5).floor) == (2, 0, 1)


def test_the_seasonal_history_folds_each_finished_slot_with_its_weight():
    profile = SeasonalProfile(period_s=4, slot_s=1, alpha=0.5)
    for t, value in [(0.1, 10), (0.5, 20), (1.2, 30), (2.5, 40), (4.1, 50), (5.0, 60)]:
        profile.observe(t, value)
    assert profile.means == [32.5, 30.0, 40.0, None]  # slot 0: 15 then 50, half and half
    assert profile.last == [50.0, 30.0, 40.0, None]
    assert profile.forecast(0.5) == 32.5 and profile.forecast(1.0) == 31.25 and profile.forecast(3.9) is None
    assert profile.table()[0] == {"slot": 0, "forecast": 32.5, "last": 50.0}
    seeded = SeasonalProfile(period_s=4, slot_s=1)
    seeded.seed([(0.2, 8), (1.3, 4)])
    assert seeded.means == [8.0, 4.0, None, None]
    assert seeded.forecast(0.6) == pytest.approx(7.6) and seeded.forecast(1.8) == 4.0 and seeded.forecast(2.2) is None
    assert seeded.forecast(3.8) is None and seeded.forecast(4.2) == 8.0
    assert SeasonalProfile().slots == 168  # hour of week


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"period_s": 0}, "period_s must be a positive whole multiple of slot_s"),
        ({"slot_s": 0}, "period_s must be a positive whole multiple of slot_s"),
        ({"period_s": 5, "slot_s": 2}, "period_s must be a positive whole multiple of slot_s"),
        ({"alpha": 0}, "alpha must be in \\(0, 1\\]"),
        ({"alpha": 1.5}, "alpha must be in \\(0, 1\\]"),
    ],
)
def test_a_seasonal_profile_refuses_a_bad_shape(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        SeasonalProfile(**kwargs)
    SeasonalProfile(alpha=1)


HOUR, WEEK = 3600.0, 7 * 24 * 3600.0


def test_an_hour_of_week_profile_puts_each_value_in_its_hour():
    profile = SeasonalProfile()  # a week of hours
    profile.seed([(3 * HOUR + 600, 5.0), (4 * HOUR + 60, 7.0), (WEEK + 3 * HOUR + 60, 9.0)])
    assert profile.means[3] == pytest.approx(7.0) and profile.means[4] == pytest.approx(7.0)  # 03:00: 5, then 9
    assert profile.last[3] == 9.0 and [i for i, m in enumerate(profile.means) if m is not None] == [3, 4]
    assert profile.forecast(WEEK + 4 * HOUR) == pytest.approx(7.0)  # 04:00 next week: between the 03:30 and 04:30 centers


def test_a_forecast_next_to_an_unseen_slot_is_the_seen_slots_own_up_to_its_half_and_none_beyond():
    """Between a seen slot's center and an unseen one's, the forecast is the seen slot's mean on the
    seen half (boundary included for the later slot) and None on the unseen half."""
    seeded = SeasonalProfile(period_s=4, slot_s=1)
    seeded.seed([(0.2, 8), (1.3, 4)])  # slots 0 and 1 seen, 2 and 3 not
    assert seeded.forecast(1.9) == 4.0 and seeded.forecast(2.0) is None  # slot 1's half ends before the boundary
    assert seeded.forecast(3.9) is None and seeded.forecast(4.0) == 8.0  # slot 0 (next period) answers from it on


def test_a_profile_may_have_slots_shorter_than_a_second():
    profile = SeasonalProfile(period_s=1.0, slot_s=0.5)
    assert profile.slots == 2
    profile.seed([(0.1, 2.0), (0.6, 6.0)])
    assert profile.means == [2.0, 6.0] and profile.forecast(0.5) == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("config", "current", "load", "expected"),
    [
        (ScalingConfig(max_replicas=4, target=0.5, tolerance=0.1), 1, 0.52, 1),  # one replica, 4 % over: holds
        (ScalingConfig(max_replicas=4, target=4.0, tolerance=0.25), 1, 5.0, 1),  # exactly at the tolerance's edge: holds
        (ScalingConfig(max_replicas=4, target=4.0, tolerance=0.25), 1, 5.5, 2),  # past it: the ceiling
        (ScalingConfig(max_replicas=4, target=4.0, tolerance=0.25), 0, 4.0, 1),  # from none: the ceiling, never "hold 0"
    ],
)
def test_a_load_within_tolerance_of_the_target_holds_the_count(config, current, load, expected):
    assert recommend(config, current, load, None)[0] == expected


def test_an_endpoint_is_idle_only_from_the_moment_the_policy_started_watching_it():
    config = ScalingConfig(min_replicas=0, max_replicas=2, target=4.0, scale_to_zero_after_s=60.0, predictive=False)
    state = PolicyState.start(1, 1000.0)  # started at t=1000 with no load seen yet
    decision, state = decide(config, state, Observation(1030.0, 0.0))
    assert decision.replicas == 1 and decision.action != ZERO  # idle 30 s of 60, not since t=0
    decision, _ = decide(config, state, Observation(1061.0, 0.0))
    assert decision.replicas == 0 and decision.action == ZERO


@pytest.mark.parametrize(
    ("target", "forecast", "predictive"),
    [
        (4.0, 0.0, None),  # a forecast of no load adds nothing
        (0.25, 0.5, 2),  # a forecast under one request still asks for what it needs
        (4.0, 0.1, 1),  # a little: one replica
        (4.0, 8.0, 2),  # exactly two replicas' worth: two, not three
    ],
)
def test_the_forecast_asks_for_the_replicas_it_would_need(target, forecast, predictive):
    config = ScalingConfig(max_replicas=8, target=target)
    raw, reactive, got = recommend(config, 0, 0.0, forecast)
    assert (reactive, got, raw) == (0, predictive, predictive or 0)


def test_from_zero_a_held_request_wakes_one_replica_and_a_heavy_load_wakes_what_it_needs():
    config = ScalingConfig(min_replicas=0, max_replicas=8, target=4.0, predictive=False)  # min 0, no scale to zero
    decision, _ = decide(config, PolicyState.start(0, 0.0), Observation(1.0, 0.0, demand=True))
    assert (decision.replicas, decision.action) == (1, WAKE)
    decision, _ = decide(config, PolicyState.start(0, 0.0), Observation(1.0, 20.0))
    assert (decision.replicas, decision.action) == (5, WAKE)


@pytest.mark.parametrize(
    "config",
    [
        ScalingConfig(min_replicas=0, max_replicas=4, target=4.0, predictive=False),  # min 0
        ScalingConfig(min_replicas=2, max_replicas=4, target=4.0, scale_to_zero_after_s=60.0, predictive=False),  # to zero
    ],
)
def test_an_idle_endpoint_at_zero_stays_there_saying_so(config):
    state = PolicyState(replicas=0, last_active=0.0)
    for now in (10.0, 100.0):  # shortly after the last load, and long after
        decision, state = decide(config, state, Observation(now, 0.0))
        assert (decision.replicas, decision.action, decision.reason) == (0, HOLD, "idle at zero replicas")


def test_a_decision_shows_the_load_per_replica_and_how_long_the_endpoint_was_idle():
    config = ScalingConfig(min_replicas=1, max_replicas=8, target=4.0, predictive=False)
    decision, state = decide(config, PolicyState.start(2, 100.0), Observation(105.0, 6.0))
    assert decision.inputs["per_replica"] == 3.0 and decision.inputs["idle_s"] is None
    decision, _ = decide(config, state, Observation(112.0, 0.0))
    assert decision.inputs["idle_s"] == 7.0 and decision.inputs["per_replica"] == 0.0


def test_a_hold_at_target_a_forecast_matching_the_load_and_an_unstable_rise_each_say_so():
    steady = ScalingConfig(min_replicas=1, max_replicas=6, target=10, predictive=False)
    assert _decisions(steady, [(0, 10), (1, 10)], replicas=1) == [(1, "hold", "load 10 ~ 1 x target 10")] * 2
    config = ScalingConfig(min_replicas=1, max_replicas=6, target=10)
    decision, _ = decide(config, PolicyState.start(1, 0.0), Observation(1, 25, 25))  # the forecast asks what the load asks
    assert (decision.replicas, decision.reason) == (3, "load 25 > 1 x 10 (forecast 25)")
    windowed = ScalingConfig(min_replicas=1, max_replicas=6, target=10, scale_up_window_s=5, scale_down_window_s=40, predictive=False)
    assert _decisions(windowed, [(0, 10), (1, 25)], replicas=1)[1] == (1, "hold", "recommendation 3 not yet stable for 5s")


def test_a_bad_tier_is_named():
    with pytest.raises(ValueError, match=r"^tier must be 1, 2 or 3 \(got 4\)$"):
        ScalingConfig(tier=4)


def test_tier_1_never_has_fewer_than_two_replicas_and_keeps_a_larger_floor():
    config = ScalingConfig(tier=1, min_replicas=1, max_replicas=1)  # a lost zone must leave one serving
    assert (config.min_replicas, config.max_replicas, config.floor) == (2, 2, 2)
    config = ScalingConfig(tier=1, min_replicas=3, max_replicas=5)
    assert (config.min_replicas, config.max_replicas) == (3, 5)
    assert (ScalingConfig(tier=2, min_replicas=1).min_replicas, ScalingConfig(tier=3, min_replicas=0).min_replicas) == (1, 0)


def test_the_edges_of_a_valid_config_are_accepted():
    config = ScalingConfig(tolerance=0.0, scale_to_zero_after_s=0.5, cold_start_budget_s=0.5, min_replicas=0)
    assert (config.tolerance, config.scale_to_zero_after_s, config.cold_start_budget_s) == (0.0, 0.5, 0.5)


# ---- a forecast wakes a scaled-to-zero endpoint ahead of its traffic (issue 29) -----------------------


def test_a_forecast_wakes_an_endpoint_at_zero_ahead_of_its_traffic_and_says_so():
    config = ScalingConfig(min_replicas=0, max_replicas=6, target=10, scale_to_zero_after_s=100, max_step_up=2, up_cooldown_s=5)
    assert _decisions(config, [(1, 0, 25)], replicas=0) == [(2, "wake", "forecast 25 at zero replicas: wake to 2 ahead of its traffic")]
    assert _decisions(config, [(1, 0, 5)], replicas=0) == [(1, "wake", "forecast 5 at zero replicas: wake to 1 ahead of its traffic")]
    bounded = replace(config, max_replicas=1, max_step_up=4)  # at most max_replicas, at most max_step_up
    assert _decisions(bounded, [(1, 0, 45)], replicas=0) == [(1, "wake", "forecast 45 at zero replicas: wake to 1 ahead of its traffic")]
    floored = ScalingConfig(min_replicas=3, max_replicas=6, target=10, scale_to_zero_after_s=100, max_step_up=1)
    assert _decisions(floored, [(1, 0, 5)], replicas=0)[0][:2] == (3, "wake")  # at least the floor
    # the up cooldown holds it (a scale-up 2 s before), then it wakes
    state = replace(PolicyState.start(0, 0.0), last_up=0.0)
    decision, state = decide(config, state, Observation(2.0, 0.0, 25))
    assert (decision.replicas, decision.action, decision.reason) == (0, HOLD, "forecast 25 at zero replicas; up cooldown (5s) not over")
    decision, _ = decide(config, state, Observation(5.0, 0.0, 25))
    assert (decision.replicas, decision.action) == (2, WAKE)
    # no forecast, a forecast of nothing, or predictive off: it stays asleep
    for forecast, cfg in ((None, config), (0.0, config), (25, replace(config, predictive=False))):
        assert _decisions(cfg, [(1, 0, forecast)], replicas=0) == [(0, "hold", "idle at zero replicas")]


def test_a_forecast_waits_for_its_up_window_at_zero():
    config = ScalingConfig(min_replicas=0, max_replicas=6, target=10, scale_up_window_s=3, scale_to_zero_after_s=100)
    steps = [(0, 0), (1, 0, 12), (3, 0, 12), (4, 0, 12)]
    assert _decisions(config, steps, replicas=0) == [
        (0, "hold", "idle at zero replicas"),
        (0, "hold", "forecast 12 at zero replicas not yet stable for 3s"),
        (0, "hold", "forecast 12 at zero replicas not yet stable for 3s"),
        (2, "wake", "forecast 12 at zero replicas: wake to 2 ahead of its traffic"),
    ]


def test_a_forecast_keeps_an_endpoint_from_zero_and_its_end_starts_the_idle_time():
    config = ScalingConfig(min_replicas=1, max_replicas=4, target=10, scale_to_zero_after_s=10, scale_down_window_s=3, down_cooldown_s=0)
    loads, forecasts = [3] + [0] * 30, [None] + [4] * 15 + [None] * 15
    counts, decisions = run(config, loads, start=1, forecasts=forecasts)
    assert counts[:25] == [1] * 25 and decisions[15].inputs["idle_s"] is None  # no load, but traffic is forecast (to tick 15)
    assert counts[25] == 0 and decisions[25].reason == "no load nor forecast for 10s (scale to zero after 10s)"
    assert decisions[20].inputs["idle_s"] == 5.0
    reactive = replace(config, predictive=False)  # predictive off: the forecast is not looked at
    counts, decisions = run(reactive, loads, start=1, forecasts=forecasts)
    assert counts.index(0) == 10 and decisions[10].reason == "no load for 10s (scale to zero after 10s)"


def _at_zero(config: ScalingConfig) -> bool:
    return config.scale_to_zero_after_s is not None or config.min_replicas == 0


def test_a_forecast_under_a_tenth_of_a_replicas_target_neither_wakes_nor_keeps_an_endpoint_from_zero():
    """A profile slot that once saw traffic forecasts a little for ever (its mean decays, never to 0):
    under WAKE_FORECAST_FRACTION of one replica's target that is not expected traffic."""
    assert WAKE_FORECAST_FRACTION == 0.1
    config = ScalingConfig(min_replicas=0, max_replicas=6, target=10, scale_to_zero_after_s=10, scale_down_window_s=3, down_cooldown_s=0)
    assert _decisions(config, [(1, 0, 0.99)], replicas=0) == [(0, "hold", "idle at zero replicas")]
    assert _decisions(config, [(1, 0, 1.0)], replicas=0) == [(1, "wake", "forecast 1 at zero replicas: wake to 1 ahead of its traffic")]
    loads = [3] + [0] * 15
    for forecast, zero_at in ((0.99, 10), (1.0, None)):
        counts, decisions = run(config, loads, start=1, forecasts=[None] + [forecast] * 15)
        assert (counts.index(0) if 0 in counts else None) == zero_at, (forecast, counts)
        assert decisions[5].inputs["idle_s"] == (5.0 if zero_at else None)


@settings(deadline=None)
@given(config=configs, idle=st.integers(1, 5), share=st.floats(WAKE_FORECAST_FRACTION, 40))
def test_at_zero_a_positive_forecast_wakes_the_endpoint_once_its_up_window_passed_and_it_stays_up(config, idle, share):
    config = replace(config, predictive=True)
    forecast = share * config.target  # at least WAKE_FORECAST_FRACTION of one replica's target
    window = math.ceil(config.scale_up_window_s / TICK)
    ticks = idle + window + settle_ticks(config, 1)
    loads, forecasts = [0.0] * ticks, [None] * idle + [forecast] * (ticks - idle)
    counts, decisions = run(config, loads, start=0, forecasts=forecasts)
    if not _at_zero(config):
        return  # never at zero while idle: the floor holds it up
    woke = idle + window  # the first tick whose up window holds no idle recommendation
    assert counts[:woke] == [0] * woke
    expected = min(config.max_replicas, max(config.floor, min(math.ceil(forecast / config.target - 1e-9), config.max_step_up), 1))
    assert (decisions[woke].action, counts[woke]) == (WAKE, expected), decisions[woke].reason
    assert decisions[woke].reason.startswith(f"forecast {forecast:g} at zero replicas: wake to {expected}")
    assert all(1 <= c <= config.max_replicas for c in counts[woke:])  # never back to zero while traffic is forecast
    reactive, _ = run(replace(config, predictive=False), loads, start=0, forecasts=forecasts)
    assert reactive == [0] * ticks  # the forecast is ignored without predictive


@settings(deadline=None)
@given(
    config=configs,
    steps=st.lists(st.tuples(st.sampled_from([0.0, 0.0, 0.0, 5.0, 80.0]), st.sampled_from([None, 0.0, 3.0, 60.0])), min_size=30, max_size=150),
)
def test_scale_to_zero_never_comes_sooner_than_its_idle_time_after_load_or_a_forecast(config, steps):
    config = replace(config, predictive=True)
    loads, forecasts = [load for load, _ in steps], [f for _, f in steps]
    counts, decisions = run(config, loads, start=1, forecasts=forecasts)
    last_expected = 0  # PolicyState.start: watched from tick 0
    for i, (load, forecast) in enumerate(steps):
        if load > 0 or (forecast or 0) >= WAKE_FORECAST_FRACTION * config.target:
            last_expected = i
        if decisions[i].action == ZERO:
            assert (i - last_expected) * TICK >= config.scale_to_zero_after_s, (i, last_expected)
            assert decisions[i].reason.startswith("no load nor forecast for")
