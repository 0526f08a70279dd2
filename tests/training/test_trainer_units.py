import io
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from training import checkpoint as ck
from training.optim import CosineWarmup, ModelEma, lr_at, param_groups
from training.progress import Progress
from training.step import soft_cross_entropy
from vit_service.models import create_model


def test_cosine_with_linear_warmup_values() -> None:
    base, total, warm, floor = 1.0, 110, 10, 0.1
    assert lr_at(0, base, total, warm, floor) == pytest.approx(0.1)  # (0 + 1) / 10
    assert lr_at(4, base, total, warm, floor) == pytest.approx(0.5)
    assert lr_at(9, base, total, warm, floor) == pytest.approx(1.0)  # warm-up ends at base
    assert lr_at(10, base, total, warm, floor) == pytest.approx(1.0, abs=1e-3)  # just below
    assert lr_at(59, base, total, warm, floor) == pytest.approx(0.55)  # half way: mean
    assert lr_at(109, base, total, warm, floor) == pytest.approx(0.1)  # the last update
    assert lr_at(500, base, total, warm, floor) == pytest.approx(0.1)  # and stays there
    # no warm-up: update 0 is already one tenth into the decay
    assert lr_at(0, 2.0, 10, 0) == pytest.approx(1.0 + math.cos(0.1 * math.pi))
    lrs = [lr_at(s, base, total, warm, floor) for s in range(warm, total)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))  # monotone decay


def test_scheduler_sets_the_optimizer_lr_and_round_trips() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=1.0)
    s = CosineWarmup(opt, 1.0, 20, 4)
    for _ in range(3):
        s.step()
    assert s.apply() == pytest.approx(1.0) and opt.param_groups[0]["lr"] == pytest.approx(1.0)
    s2 = CosineWarmup(opt, 1.0, 20, 4)
    s2.load_state_dict(s.state_dict())
    assert s2.apply() == s.apply()


@pytest.mark.parametrize("name", ["vit_test", "text_test"])
def test_no_weight_decay_on_norms_biases_and_embeddings(name: str) -> None:
    model = create_model(name)
    decay, no_decay = param_groups(model, 0.05)
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    nd = {names[id(p)] for p in no_decay["params"]}
    d = {names[id(p)] for p in decay["params"]}
    assert d | nd == set(names.values()) and not d & nd
    assert all(n.endswith(".bias") or "norm" in n or n in model.no_weight_decay() for n in nd)
    assert {n for n in names.values() if "norm" in n or n.endswith(".bias")} <= nd
    assert {"blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.weight", "head.weight"} <= d
    if name == "vit_test":
        assert {"cls_token", "pos_embed", "patch_embed.proj.bias"} <= nd
        assert "patch_embed.proj.weight" in d
    else:
        assert "tok_embed.weight" in nd


def test_soft_cross_entropy_matches_label_smoothing() -> None:
    logits = torch.randn(5, 7)
    y = torch.randint(0, 7, (5,))
    from training.augment import smooth_one_hot

    ref = F.cross_entropy(logits, y, label_smoothing=0.1)
    torch.testing.assert_close(soft_cross_entropy(logits, smooth_one_hot(y, 7, 0.1)), ref)


def test_ema_follows_the_model_with_warmup() -> None:
    m = torch.nn.Linear(2, 2)
    ema = ModelEma(m, decay=0.99)
    with torch.no_grad():
        m.weight.add_(1.0)
    before = ema.module.weight.clone()
    ema.update(m)  # decay min(0.99, 2/11)
    d = 2 / 11
    torch.testing.assert_close(ema.module.weight, before * d + m.weight * (1 - d))
    assert not ema.module.weight.requires_grad


def test_rng_states_survive_a_weights_only_checkpoint(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.normal()  # leave a cached gaussian in numpy's state
    path = ck.save_checkpoint(tmp_path / "c.pt", {"rng": [ck.rng_state()], "step": 3})
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    state = ck.load_checkpoint(path)  # weights_only=True
    ck.set_rng_state(state["rng"][0])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_checkpoint_write_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = ck.save_checkpoint(tmp_path / "last.pt", {"step": 1, "w": torch.ones(3)})

    def broken_save(obj: object, f: io.BufferedWriter) -> None:
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        ck.save_checkpoint(path, {"step": 2, "w": torch.zeros(3)})
    monkeypatch.undo()
    assert ck.load_checkpoint(path)["step"] == 1  # the old checkpoint is intact
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temp file left


def test_find_checkpoint(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    for name, recipe in (("a-1", "cifar10-smoke"), ("b-1", "imdb-smoke")):
        (runs / name / "checkpoints").mkdir(parents=True)
        (runs / name / ck.RUN_INFO).write_text(json.dumps({"recipe": recipe}))
        ck.save_checkpoint(runs / name / "checkpoints" / ck.LAST, {"step": 0})
    assert ck.find_checkpoint(runs, "auto", recipe="cifar10-smoke").parent.parent.name == "a-1"
    assert ck.find_checkpoint(runs, "auto", run_name="b-1").parent.parent.name == "b-1"
    assert ck.find_checkpoint(runs, str(runs / "a-1")).name == ck.LAST
    with pytest.raises(FileNotFoundError):
        ck.find_checkpoint(runs, "auto", recipe="cifar10-vit")


def test_progress_writes_json_lines_when_not_a_tty() -> None:
    out = io.StringIO()  # isatty() is False
    p = Progress(stream=out)
    p.start(10, mlflow_run_id="abc", run_name="r")
    p.step(5, 0, loss=1.5, lr=1e-3, throughput=100.0, acc=0.5, data_time_frac=0.1)
    p.epoch(10, 0, val_loss=1.2, val_acc=0.6)
    p.end(status="finished", val_acc=0.6)
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["event"] for e in events] == ["start", "step", "epoch", "end"]
    assert all(e["mlflow_run_id"] == "abc" for e in events)
    step = events[1]
    assert {"epoch", "step", "total_steps", "loss", "lr", "throughput", "eta_s"} <= set(step)
    assert step["total_steps"] == 10 and events[2]["val_acc"] == 0.6
    silent = io.StringIO()
    q = Progress(enabled=False, stream=silent)  # non-zero DDP ranks
    q.start(3)
    q.step(1, 0, loss=1.0)
    assert silent.getvalue() == ""
