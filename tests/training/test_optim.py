"""The schedule, the budget planner and the optimizer factory (training/optim.py)."""

import pytest
import torch

from training.optim import BudgetPlanner, LrSchedule, build_optimizer, lr_at


def _opt() -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)


def _run(s: LrSchedule, n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(s.apply())
        s.step()
    return out


@pytest.mark.parametrize("shape", ["linear", "cosine"])
def test_schedule_matches_the_closed_form_and_ends_on_min_lr(shape: str) -> None:
    s = LrSchedule(_opt(), 1.0, 50, 5, 0.01, shape)  # type: ignore[arg-type]
    lrs = _run(s, 50)
    assert lrs == pytest.approx([lr_at(k, 1.0, 50, 5, 0.01, shape) for k in range(50)])  # type: ignore[arg-type]
    assert lrs[4] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.01)
    assert all(a >= b for a, b in zip(lrs[5:], lrs[6:], strict=False))


def test_linear_decay_is_linear() -> None:
    lrs = _run(LrSchedule(_opt(), 1.0, 11, 1, 0.0, "linear"), 11)
    assert lrs[1:] == pytest.approx([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0])


def test_replanning_keeps_the_lr_continuous_and_hits_the_final_lr_at_the_new_end() -> None:
    s = LrSchedule(_opt(), 1.0, 100, 10, 0.0, "linear")
    lrs = _run(s, 40)
    s.set_total_steps(70)  # the machine got slower: fewer steps than planned
    more = _run(s, 30)
    assert more[-1] == pytest.approx(0.0) and s.step_num == 70
    jumps = [abs(a - b) for a, b in zip(lrs + more, (lrs + more)[1:], strict=False)]
    assert max(jumps[10:]) < 0.05  # no jump at the re-plan
    s2 = LrSchedule(_opt(), 1.0, 100, 10, 0.0, "linear")
    _run(s2, 40)
    s2.set_total_steps(200)  # faster: more steps, still ending on 0
    assert _run(s2, 160)[-1] == pytest.approx(0.0)


def test_schedule_state_round_trips_mid_decay() -> None:
    s = LrSchedule(_opt(), 1.0, 30, 3, 0.0, "cosine")
    _run(s, 12)
    s.set_total_steps(25)
    s2 = LrSchedule(_opt(), 1.0, 30, 3, 0.0, "cosine")
    s2.load_state_dict(s.state_dict())
    assert _run(s2, 13) == pytest.approx(_run(s, 13))


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_budget_plans_to_the_deadline_from_the_measured_rate() -> None:
    clock = FakeClock()
    b = BudgetPlanner(100.0, clock.t, reserve_s=10.0, warmup_steps=2, replan_every_s=5.0,
                      clock=clock)
    plans = []
    step = 0
    while True:  # 0.5 s per step for the first 20 s, then 1 s per step (load arrives)
        clock.t += 0.5 if clock.t < 1020 else 1.0
        step += 1
        p = b.observe(step)
        if p is not None:
            plans.append(p)
        if plans and step >= plans[-1]:
            break
        assert step < 1000, "the plan never ended"
    assert plans[0] == pytest.approx(2 + 90 / 0.5, abs=6)  # first plan: at 2 steps/s
    end = clock.t - 1000
    assert 85 <= end <= 90.5  # done by deadline - reserve, whatever the load did
    assert b.first_plan is not None and b.first_plan["steps_per_s"] == pytest.approx(2.0)


def test_budget_pauses_exclude_evaluations_and_count_evals_left() -> None:
    clock = FakeClock()
    b = BudgetPlanner(60.0, clock.t, reserve_s=0.0, warmup_steps=0, replan_every_s=1.0,
                      clock=clock)
    b.eval_s = 5.0
    b.observe(0)
    for step in range(1, 4):
        clock.t += 1.0
        if step == 2:  # an evaluation of 3 s between two steps
            b.pause()
            clock.t += 3.0
            b.resume()
        plan = b.observe(step, steps_per_eval=10)
    assert b.rate == pytest.approx(1.0)  # 3 steps in 3 s of training
    assert plan == 3 + int((60 - 6) / (1.0 + 5.0 / 10))  # a 5 s evaluation every 10 steps


def test_budget_resume_counts_the_time_already_used() -> None:
    clock = FakeClock()
    b = BudgetPlanner(100.0, clock.t, reserve_s=0.0, clock=clock)
    clock.t += 40
    state = b.state_dict()
    clock.t += 500  # the run was down for a while
    b2 = BudgetPlanner(100.0, clock.t, reserve_s=0.0, clock=clock)
    b2.load_state_dict(state)
    assert b2.time_left() == pytest.approx(60.0)


def test_budget_resume_measures_after_the_warm_up() -> None:
    # a resumed run recompiles its step: its first updates stall and must not set the rate
    clock = FakeClock()
    b = BudgetPlanner(1000.0, clock.t, reserve_s=0.0, warmup_steps=5, clock=clock)
    b.load_state_dict({"used_s": 100.0, "planned_steps": 900, "eval_s": 0.0})
    plan, step = None, 400
    while plan is None:
        clock.t += 5.0 if step < 404 else 1.0  # four stalled updates, then 1 s each
        step += 1
        plan = b.observe(step)
    assert step == 400 + 5 + 3  # measured from the fifth update on, planned after three
    assert b.rate == pytest.approx(1.0)


def test_fused_adamw_falls_back_where_there_is_no_fused_kernel() -> None:
    model = torch.nn.Linear(3, 2)
    opt = build_optimizer(model, 1e-3, 0.05, (0.9, 0.999), 1e-8, None, fused=True)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()  # runs on CPU whichever implementation was chosen
    assert opt.param_groups[0]["weight_decay"] == 0.05


def test_fused_adamw_failure_falls_back_to_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.optim.AdamW
    calls = []

    def no_fused(*args, **kw):  # a build or device without the fused kernel
        calls.append(kw.get("fused"))
        if kw.get("fused"):
            raise RuntimeError("`fused=True` requires all the params to be floating point "
                               "Tensors of supported devices")
        return real(*args, **kw)

    monkeypatch.setattr(torch.optim, "AdamW", no_fused)
    opt = build_optimizer(torch.nn.Linear(3, 2), 1e-3, 0.0, (0.9, 0.999), 1e-8, None, True)
    assert calls == [True, None] and isinstance(opt, real)


def test_budget_fit_sizes_a_run_whose_early_stage_is_cheaper() -> None:
    # stage 0 (the first half of the run) costs a quarter of a full step: measured there at
    # 0.25 s per step, the full-size steps will take 1 s; 100 s = 0.5 N 0.25 + 0.5 N 1 -> 160
    b = BudgetPlanner(100.0, 0.0, reserve_s=0.0, stages=[(0.5, 0.25), (1.0, 1.0)])
    assert b._fit(0, 100.0, 0.25, 0.0) == 160
    b._stage = 1  # measured in the full-size stage at 1 s per step: only the steps left
    assert b._fit(80, 40.0, 1.0, 0.0) == 120
    one = BudgetPlanner(100.0, 0.0, reserve_s=0.0)  # one stage: left / per step, as before
    assert one._fit(10, 50.0, 0.5, 0.5) == 10 + 50


def test_budget_with_stages_ends_on_time_and_keeps_the_stage_split() -> None:
    from training.resolution import ResolutionSchedule

    clock = FakeClock()
    res = ResolutionSchedule([(0.5, 16)], full_size=32, patch_size=4)  # costs 17/65, 1
    b = BudgetPlanner(200.0, clock.t, reserve_s=0.0, warmup_steps=2, replan_every_s=5.0,
                      clock=clock, stages=res.stages)
    total, step, switch = 10_000, 0, None
    while step < total:
        res.advance(step, total)
        if res.size == 32 and switch is None:
            switch = step
        clock.t += 1.0 if res.size == 32 else 0.3  # the real cost differs from the estimate
        step += 1
        p = b.observe(step, stage=res.stage)
        total = p if p is not None else total
    assert 195 <= clock.t - 1000 <= 200.5  # on time, although the 16-px steps cost 0.3, not 0.26
    assert switch is not None and 0.4 <= switch / step <= 0.55  # about half the steps at 16 px
    assert 290 <= step <= 320  # 200 s = 0.5 N 0.3 + 0.5 N 1 -> ~307 steps


def test_a_stage_whose_first_steps_stall_is_not_skipped() -> None:
    # A new image size recompiles the step: its first updates stall. Measured from the
    # stage's first update, a few stalled updates made the 24-px stage look ~6x dearer, the
    # plan shrank below the stage's end and the run went straight on to 32 px.
    from training.resolution import ResolutionSchedule

    clock = FakeClock()
    res = ResolutionSchedule([(0.4, 16), (0.7, 24)], full_size=32, patch_size=4,
                             patch_dropout=0.5)
    b = BudgetPlanner(600.0, clock.t, reserve_s=0.0, clock=clock, stages=res.stages)
    cost = {16: 0.09, 24: 0.13, 32: 0.22}  # seconds per update, once warm
    total, step, entered, stage_steps = 10_000, 0, {}, {16: 0, 24: 0, 32: 0}
    while step < total:
        res.advance(step, total)
        first = entered.setdefault(res.size, step)
        clock.t += cost[res.size] + (1.0 if step - first < 4 else 0.0)  # the stall
        stage_steps[res.size] += 1
        step += 1
        p = b.observe(step, stage=res.stage)
        total = p if p is not None else total
    assert 0.2 <= stage_steps[24] / step <= 0.4, stage_steps  # its ~30 %, not 4 updates
    assert 590 <= clock.t - 1000 <= 600.5  # and still on time
