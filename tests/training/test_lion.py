"""Lion (training/lion.py) against the paper's update written out per tensor, and chosen by
the recipe's ``optim.optimizer``."""

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


@pytest.mark.parametrize("bad", [{"lr": 0.0}, {"betas": (0.9, 1.0)}, {"weight_decay": -1.0}])
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
