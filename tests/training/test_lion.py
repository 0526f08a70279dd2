"""Lion (training/lion.py) against the paper's update written out per tensor, and chosen by
the recipe's ``optim.optimizer``."""

import io
import re

import pytest
import torch

from training.lion import Lion
from training.optim import build_optimizer
from training.recipes import RecipeError, load_recipe


def _reference_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, lr: float,
                    betas: tuple[float, float], wd: float) -> None:
    c = betas[0] * m + (1 - betas[0]) * g
    p.mul_(1 - lr * wd).add_(torch.sign(c), alpha=-lr)
    m.mul_(betas[1]).add_(g, alpha=1 - betas[1])


def test_lion_matches_the_update_written_out_per_tensor() -> None:
    torch.manual_seed(0)
    shapes = [(5, 3), (3,), (2, 2, 2)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [p.detach().clone() for p in params]
    moms = [torch.zeros_like(p) for p in params]
    # two groups, as the trainer builds them: decayed matrices, undecayed the rest
    opt = Lion([{"params": params[:1], "weight_decay": 0.3},
                {"params": params[1:], "weight_decay": 0.0}], lr=0.01, betas=(0.9, 0.99))
    for _ in range(4):
        grads = [torch.randn(s) for s in shapes]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        for i, (r, g, m) in enumerate(zip(ref, grads, moms, strict=True)):
            _reference_step(r, g, m, 0.01, (0.9, 0.99), 0.3 if i == 0 else 0.0)
    for p, r, m in zip(params, ref, moms, strict=True):
        torch.testing.assert_close(p.detach(), r)
        torch.testing.assert_close(opt.state[p]["exp_avg"], m)


def test_lion_moves_every_coordinate_by_lr_and_skips_params_without_grad() -> None:
    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.ones(2))
    opt = Lion([a, b], lr=0.5)
    a.grad = torch.tensor([1e-6, -3.0, 2.0, -1e-6])  # magnitude does not matter, only sign
    opt.step()
    assert a.detach().tolist() == [-0.5, 0.5, -0.5, 0.5]
    assert b.detach().tolist() == [1.0, 1.0] and b not in opt.state
    sd = opt.state_dict()  # checkpoints hold one momentum per stepped parameter
    assert list(sd["state"]) == [0] and set(sd["state"][0]) == {"exp_avg"}


def test_lion_steps_at_the_lr_the_schedule_wrote_into_each_group() -> None:
    # the trainer's LrSchedule writes group["lr"] before every update; the constructor's lr is
    # only the default
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3))
    ref_a, ref_b = a.detach().clone(), b.detach().clone()
    m_a, m_b = torch.zeros(4), torch.zeros(3)
    opt = Lion([{"params": [a], "weight_decay": 0.2}, {"params": [b]}], lr=1.0)
    for lrs in [(0.01, 0.02), (0.005, 0.0)]:
        for group, lr in zip(opt.param_groups, lrs, strict=True):
            group["lr"] = lr
        ga, gb = torch.randn(4), torch.randn(3)
        a.grad, b.grad = ga.clone(), gb.clone()
        opt.step()
        _reference_step(ref_a, ga, m_a, lrs[0], (0.9, 0.99), 0.2)
        _reference_step(ref_b, gb, m_b, lrs[1], (0.9, 0.99), 0.0)
    torch.testing.assert_close(a.detach(), ref_a)
    torch.testing.assert_close(b.detach(), ref_b)


def test_lion_resumed_from_its_state_dict_continues_the_same_trajectory() -> None:
    torch.manual_seed(0)
    grads = [torch.randn(5) for _ in range(6)]

    def run(steps: range, p: torch.nn.Parameter, opt: Lion) -> None:
        for i in steps:
            p.grad = grads[i].clone()
            opt.step()

    p = torch.nn.Parameter(torch.ones(5))
    opt = Lion([p], lr=0.1, weight_decay=0.1)
    run(range(6), p, opt)  # six updates in one go

    q = torch.nn.Parameter(torch.ones(5))
    first = Lion([q], lr=0.1, weight_decay=0.1)
    run(range(3), q, first)
    saved = torch.load(_roundtrip(first.state_dict()), weights_only=True)  # as a checkpoint
    resumed = Lion([q], lr=0.1, weight_decay=0.1)
    resumed.load_state_dict(saved)
    run(range(3, 6), q, resumed)  # the momentum carried over: the same weights
    torch.testing.assert_close(q.detach(), p.detach())
    torch.testing.assert_close(resumed.state[q]["exp_avg"], opt.state[p]["exp_avg"])


def _roundtrip(obj: object) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


@pytest.mark.parametrize("bad", [{"lr": 0.0}, {"lr": float("nan")}, {"betas": (0.9, 1.0)},
                                 {"betas": (0.9,)}, {"weight_decay": -1.0},
                                 {"weight_decay": float("nan")}])
def test_lion_refuses_bad_hyperparameters(bad: dict) -> None:
    with pytest.raises(ValueError, match="Lion"):
        Lion([torch.nn.Parameter(torch.zeros(1))], **bad)


def test_recipe_chooses_the_optimizer() -> None:
    model = torch.nn.Linear(3, 2)
    o = load_recipe("cifar10-smoke", {"optim.optimizer": "lion", "optim.lr": 3e-4,
                                      "optim.weight_decay": 0.5}).optim
    opt = build_optimizer(model, o.lr, o.weight_decay, o.betas, o.eps, o.layer_decay,
                          fused=True, algorithm=o.optimizer)
    assert isinstance(opt, Lion)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]  # bias not decayed
    assert load_recipe("cifar10-smoke", {}).optim.optimizer == "adamw"
    with pytest.raises(RecipeError, match="optimizer"):
        load_recipe("cifar10-smoke", {"optim.optimizer": "sgd"})


def test_lion_takes_its_own_betas_unless_the_recipe_sets_them() -> None:
    assert load_recipe("cifar10-smoke", {}).optim.betas == (0.9, 0.999)  # the recipe's own
    from training.recipe_parts import OptimSpec

    assert OptimSpec(lr=1e-4, optimizer="lion").betas == (0.9, 0.99)
    assert OptimSpec(lr=1e-4).betas == (0.9, 0.999)
    assert OptimSpec(lr=1e-4, optimizer="lion", betas=(0.95, 0.98)).betas == (0.95, 0.98)


@pytest.mark.parametrize(("overrides", "says"), [
    ({"optim.betas": [0.9, 1.0]}, "optim.betas"),
    ({"optim.betas": [-0.1, 0.9]}, "optim.betas"),
    ({"optim.lr": 2.0, "optim.weight_decay": 0.5}, "lr * optim.weight_decay"),
])
def test_recipe_refuses_optimizer_settings_that_cannot_train(overrides: dict, says: str) -> None:
    with pytest.raises(RecipeError, match=re.escape(says)):
        load_recipe("cifar10-smoke", overrides)
