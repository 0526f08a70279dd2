"""The training run shared by the image and text tasks: :class:`Trainer` runs one assembled
run (:func:`training.setup.build_run`: the data on the device, the model with its initial
weights, AdamW with weight-decay groups, the per-update schedule, an optional EMA). It steps
(:mod:`training.step`), evaluates every ``eval_every`` epochs (the last pass always fp32),
checkpoints atomically (:mod:`training.run_state`), logs to MLflow, and at the end hands a
:class:`Outcome` to :mod:`training.publish`: the bundle, its registration and the ``champion``
alias if it is better. :mod:`training.run` assembles a run and calls it.

``budget_minutes``: the run is sized to the wall clock instead of ``epochs``
(:class:`training.run_budget.BudgetController`, re-planned from the measured throughput).

Stopping: ``max_steps`` (status ``stopped``; the model is still evaluated and registered),
SIGTERM (status ``interrupted``: checkpoint at the end of the current step, MLflow run marked
KILLED, exit code 143) or SIGINT (same, exit code 130). A resumed run continues from its
checkpoint with the same step count, optimiser, schedule, RNG states and MLflow run.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training import checkpoint as ckpt_io
from training.distributed import any_true
from training.evaluate import EvalResult, LossResult
from training.progress import RunStatus
from training.publish import Outcome, publish, rehearse_publish
from training.recipes import Recipe
from training.run_budget import BudgetController
from training.run_state import RunState
from training.setup import RunSetup, run_params, train_module
from training.signals import StopFlag
from training.step import StepWindow, train_step
from training.validation import Validator
from vit_service.models import count_parameters

log = logging.getLogger(__name__)

# called on every rank after each checkpoint, with its path on rank 0 (None on the others) and
# the step: how a Ray Train worker hands each checkpoint to Ray's storage (training/ray_train.py)
CheckpointHook = Callable[[Path | None, int], None]


@dataclass
class TrainResult:
    status: RunStatus  # finished | stopped (max_steps) | interrupted (signal)
    step: int
    epoch: int
    run_name: str
    run_dir: Path
    val_acc: float | None = None  # None for the pretraining objectives
    val_loss: float | None = None
    mlflow_run_id: str | None = None
    registered_version: str | None = None
    checkpoint: Path | None = None
    exit_code: int = 0


class Trainer:
    """Runs one assembled run (:class:`RunSetup`): the loop, evaluation, checkpoints and the
    end; its position is a :class:`RunState`."""

    def __init__(self, setup: RunSetup, on_checkpoint: CheckpointHook | None = None) -> None:
        self.setup = setup
        self.on_checkpoint = on_checkpoint
        self.parts = setup.parts
        self.state = RunState(total_steps=setup.recipe.epochs * setup.steps_per_epoch)
        self.stop = StopFlag()
        self.validator = Validator(setup.recipe, setup.task, setup.dist)
        self._loop_start: tuple[float, int] | None = None  # (monotonic s, step) of the loop
        self.budget: BudgetController | None = None
        if self.parts.budget is not None:
            r = setup.recipe
            self.budget = BudgetController(
                self.parts.budget, setup.dist, setup.mlrun, batch_size=r.batch_size,
                steps_per_epoch=setup.steps_per_epoch, eval_every=r.eval_every,
                warmup_steps=setup.warmup_steps if r.optim.warmup_fraction is not None
                else None)

    # the parts a caller inspects before training (tests, benchmarks)
    @property
    def recipe(self) -> Recipe:
        return self.setup.recipe

    @property
    def task(self) -> Any:
        return self.setup.task

    @property
    def model(self) -> nn.Module:
        return self.parts.model

    @property
    def lineage(self) -> Any:
        return self.setup.lineage

    def eval_model(self) -> nn.Module:
        return self.parts.eval_model()

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, final: bool = True) -> EvalResult | LossResult:
        """A validation pass of the evaluated weights (:meth:`Validator.run`), recorded as the
        run's last; the model goes back to training mode."""
        res = self.validator.run(self.eval_model(), final)
        self.state.last_eval, self.state.last_eval_step = res, self.state.step
        self._set_train_mode()
        return res

    def _set_train_mode(self) -> None:
        """Training mode; with a frozen encoder, only the head (no dropout in the encoder)."""
        self.parts.model.train()
        if self.setup.recipe.freeze_encoder:
            for name, child in self.parts.model.named_children():
                if name not in ("head", "head_drop"):
                    child.eval()

    @staticmethod
    def _val_metrics(res: EvalResult | LossResult) -> dict[str, float]:
        if res.acc is None:
            return {"val/loss": res.loss, "val_loss": res.loss}
        return {"val/loss": res.loss, "val/acc": res.acc, "val_acc": res.acc}

    def _outcome(self, served: EvalResult | None = None) -> Outcome:
        s = self.setup
        return Outcome(recipe=s.recipe, task=s.task, model=self.eval_model(),
                       model_config=s.model_config, lineage=s.lineage, run_dir=s.run_dir,
                       run_name=s.run_name, step=self.state.step,
                       ema=self.parts.ema is not None, result=self.state.last_eval,
                       served=served)

    # ------------------------------------------------------------------ checkpoints

    def _save(self, status: str, run_id: str | None) -> Path:
        s = self.setup
        identity = {"recipe": s.recipe.to_dict(), "objective": s.recipe.objective,
                    "model_config": s.model_config,
                    "tokenizer": s.task.tokenizer.to_str() if s.task.tokenizer else None,
                    "lineage": s.lineage.to_dict(), "mlflow_run_id": run_id,
                    "run_name": s.run_name}
        ck = self.state.to_checkpoint(self.parts, identity, status, s.dist)  # collective
        if s.dist.is_main:
            ckpt_io.save_checkpoint(s.ckpt_path, ck)
        self.state.saved_step = self.state.step
        if self.on_checkpoint is not None:  # on every rank, like the save's collective
            self.on_checkpoint(s.ckpt_path if s.dist.is_main else None, self.state.step)
        return s.ckpt_path

    def _start_tracking(self) -> str | None:
        s, r = self.setup, self.setup.recipe
        run_id = s.ckpt.get("mlflow_run_id") if s.ckpt else None
        if s.mlrun is not None:
            tags = {"vit_service.recipe": r.name, "vit_service.task": r.task,
                    "vit_service.objective": r.objective,
                    "vit_service.run_dir": str(s.run_dir.resolve()), **s.lineage.tags()}
            new = run_id is None
            run_id = s.mlrun.start(r, s.run_name, run_id, tags)
            if new:
                s.mlrun.log_recipe(r, s.model_config, {
                    **run_params(s, self.state.total_steps),
                    # what the champion check compares: scores count only on the same split
                    s.mlrun.tracking.SPLIT_PARAM: s.task.val_fingerprint()})
                if r.uploaded and r.data.dataset is not None:  # the data the model saw
                    s.mlrun.log_dataset(s.datasets.get(r.data.dataset),
                                        s.datasets.data_path(r.data.dataset))
                if s.lineage.init != "scratch":
                    s.mlrun.log_lineage(s.lineage.to_dict(), s.init_source.parent_recipe
                                        if s.init_source else None)
        if s.dist.is_main:
            s.run_dir.mkdir(parents=True, exist_ok=True)
            (s.run_dir / ckpt_io.RUN_INFO).write_text(json.dumps(
                {"recipe": r.name, "run_name": s.run_name, "mlflow_run_id": run_id}))
            (s.run_dir / "recipe.yaml").write_text(r.to_yaml())
        return run_id

    # ------------------------------------------------------------------ the run

    def run(self) -> TrainResult:
        """Train with this process's log records also appended to ``<run dir>/train.log``."""
        s = self.setup
        handler = None
        if s.dist.is_main:
            s.run_dir.mkdir(parents=True, exist_ok=True)
            handler = logging.FileHandler(s.run_dir / "train.log")
            handler.setFormatter(
                logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            logging.getLogger().addHandler(handler)
        try:
            run_id = self._start_tracking()
            if s.ckpt is not None:
                self.state = RunState.from_checkpoint(s.ckpt, self.parts, s.dist, s.recipe.seed,
                                                      self.state.total_steps)
                if self.state.step >= self.state.total_steps:
                    log.info("run %s already finished; nothing to do", s.run_name)
                    if s.mlrun is not None:
                        s.mlrun.end()
                    return TrainResult(RunStatus.finished, self.state.step, self.state.epoch,
                                       s.run_name, s.run_dir, mlflow_run_id=run_id,
                                       checkpoint=s.ckpt_path)
            self.stop.install()
            status = RunStatus.finished
            try:
                status = self._loop(self._train_module(), run_id)
            finally:
                self.stop.restore()
            return self._finish(status, run_id)
        finally:
            if handler is not None:
                logging.getLogger().removeHandler(handler)
                handler.close()

    def _train_module(self) -> nn.Module:
        s, r = self.setup, self.setup.recipe
        log.info("model %s: %.2fM params; %d steps/epoch x %d epochs = %d steps; batch %d on "
                 "%s x%d%s", r.model.name, count_parameters(self.model) / 1e6,
                 s.steps_per_epoch, r.epochs, self.state.total_steps, r.batch_size, s.device,
                 s.dist.world_size, " (bf16)" if s.execution.dtype else "")
        return train_module(self.model, s.dist, r.compile, s.task.kind)

    def probe_budget(self) -> None:
        """Budget mode, before the first step: size what the plan keeps for the end."""
        assert self.budget is not None
        s = self.setup

        def timed(measure: Callable[..., float | None]) -> Callable[..., float | None]:
            def run(*args: float) -> float | None:
                try:
                    return measure(self.eval_model(), *args)
                finally:
                    self._set_train_mode()
            return run

        def rehearse() -> float:
            try:
                return rehearse_publish(self._outcome(), s.mlrun is not None)
            finally:
                self._set_train_mode()

        self.budget.probe(timed(lambda m: self.validator.time_pass(m, final=False)),
                          timed(self.validator.time_end), rehearse, s.mlrun is not None)

    def _loop(self, train_model: nn.Module, run_id: str | None) -> RunStatus:
        """Steps until the schedule's end, ``max_steps`` or a signal; returns the status."""
        s, r, st, p = self.setup, self.setup.recipe, self.state, self.parts
        s.progress.start(st.total_steps, step=st.step, mlflow_run_id=run_id,
                         run_name=s.run_name, run_dir=str(s.run_dir), epochs=r.epochs,
                         steps_per_epoch=s.steps_per_epoch)
        win = StepWindow(has_acc=not r.pretraining)
        self._loop_start = (time.monotonic(), st.step)
        self._set_train_mode()
        if self.budget is not None:
            self.probe_budget()
        while st.step < st.total_steps:
            t_epoch = time.perf_counter()
            while st.batch_in_epoch < s.steps_per_epoch and st.step < st.total_steps:
                if self._at_max_steps():
                    return RunStatus.stopped
                if any_true(self.stop.signum is not None, s.dist):
                    return RunStatus.interrupted
                t0 = time.perf_counter()
                size = self._resolution()
                batch = s.task.train_batch(st.epoch, st.batch_in_epoch, size)
                t_data = time.perf_counter() - t0
                lr = p.scheduler.apply()
                loss, logits, gnorm = train_step(train_model, p.model, s.task, batch,
                                                 p.optimizer, r.optim.grad_clip,
                                                 s.execution.dtype)
                p.scheduler.step()
                if p.ema is not None:
                    p.ema.update(p.model)
                st.step += 1
                st.batch_in_epoch += 1
                correct = (0.0 if logits is None or batch.targets is None else
                           (logits.argmax(-1) == batch.targets.argmax(-1)).sum())
                win.add(loss.detach(), correct, batch, gnorm, t_data, time.perf_counter() - t0)
                if self.budget is not None:
                    stage = s.resolution.stage if s.resolution is not None else 0
                    planned = self.budget.replan(st.step, stage, p.scheduler)
                    if planned is not None:
                        st.total_steps = s.progress.total_steps = planned
                if st.step % r.log_every == 0 or st.step in (r.max_steps, st.total_steps):
                    self._log_window(win, lr)
            if st.batch_in_epoch < s.steps_per_epoch:
                break  # budget mode: the plan ends mid-epoch (evaluated in _finish)
            self._end_epoch(t_epoch, run_id)
            win.reset()  # keep evaluation and checkpointing out of the throughput window
        return RunStatus.finished

    def _resolution(self) -> int | None:
        """Progressive resizing: the image size of the next step (None: the data's)."""
        s = self.setup
        if s.resolution is None:
            return None
        if (s.resolution.advance(self.state.step, self.state.total_steps)
                and s.mlrun is not None):
            s.mlrun.log_metrics({"train/resolution": s.resolution.size}, self.state.step)
        return s.resolution.size

    def _at_max_steps(self) -> bool:
        m = self.setup.recipe.max_steps
        return m is not None and self.state.step >= m

    def _end_epoch(self, t_epoch: float, run_id: str | None) -> None:
        s, r, st = self.setup, self.setup.recipe, self.state
        if self.budget is not None:
            self.budget.pause()
        st.epoch += 1
        st.batch_in_epoch = 0
        done = st.step >= st.total_steps
        res, eval_s = None, None
        if st.epoch % r.eval_every == 0 or done:
            t_eval = time.perf_counter()
            # the run's last pass (the schedule's end, or max_steps) is the fp32 one; a run
            # that ends mid-epoch gets its fp32 pass in _finish
            res = self.evaluate(final=done or self._at_max_steps())
            eval_s = time.perf_counter() - t_eval  # what one evaluation costs, for the plan
        metrics = {**(self._val_metrics(res) if res is not None else {}), "epoch": st.epoch,
                   "time/epoch_s": time.perf_counter() - t_epoch}
        if s.mlrun is not None:
            s.mlrun.log_metrics(metrics, st.step)
        val = {} if res is None else {"val_loss": res.loss, "val_acc": res.acc}
        s.progress.epoch(st.step, st.epoch - 1, **val, epoch_time_s=metrics["time/epoch_s"])
        log.info("epoch %d%s step %d%s (%.0fs)", st.epoch,
                 "" if self.budget is not None else f"/{r.epochs}", st.step,
                 "" if res is None else f": val_loss {res.loss:.4f}"
                 + ("" if res.acc is None else f" val_acc {res.acc:.4f}"),
                 metrics["time/epoch_s"])
        if st.epoch % r.checkpoint_every == 0 or done:
            self._save("finished" if done else "running", run_id)
        if self.budget is not None:
            self.budget.resume(eval_s)

    def _log_window(self, win: StepWindow, lr: float) -> None:
        s = self.setup
        if s.device.type == "cuda":
            torch.cuda.synchronize(s.device)
        m = win.flush(s.dist.world_size)
        if m is None:
            return
        m["lr"] = lr
        if s.mlrun is not None:
            s.mlrun.log_metrics({f"train/{k}": v for k, v in m.items()}, self.state.step)
        s.progress.step(self.state.step, self.state.epoch, **m)

    def _finish(self, status: RunStatus, run_id: str | None) -> TrainResult:
        s, st = self.setup, self.state
        t_end = time.monotonic()  # training is over: what follows is the end the plan kept
        exit_code = self.stop.exit_code if status == RunStatus.interrupted else 0
        if st.saved_step != st.step or status != RunStatus.finished:
            self._save(status, run_id)
        version = None
        if status != RunStatus.interrupted and st.last_eval_step != st.step:
            res = self.evaluate()  # stopped mid-epoch: evaluate where we are
            if s.mlrun is not None:
                s.mlrun.log_metrics(self._val_metrics(res), st.step)
        if s.dist.is_main and status != RunStatus.interrupted and st.last_eval is not None:
            fp32 = st.last_eval.acc if isinstance(st.last_eval, EvalResult) else None
            served = self.validator.served(self.eval_model(), fp32)
            version = publish(self._outcome(served), s.mlrun, run_id,
                              s.recipe.register_as if s.register else None)
        res = st.last_eval
        if s.mlrun is not None and self._loop_start is not None:
            # updates per second over the loop (evaluations and checkpoints included), so
            # that runs on different machines compare (the machine.* params say which); a
            # param only for a run that did not resume (MLflow params never change)
            t0, step0 = self._loop_start
            rate = round((st.step - step0) / max(1e-9, t_end - t0), 4)
            s.mlrun.log_metrics({"train/steps_per_s": rate}, st.step)
            if s.ckpt is None:
                s.mlrun.log_params({"train.steps_per_s": rate})
        if self.budget is not None:
            stopped = s.recipe.max_steps is not None and st.step >= s.recipe.max_steps
            self.budget.report(st.step, "stopped by max_steps" if stopped else status,
                               time.monotonic() - t_end)
        s.progress.end(status=status, step=st.step, epoch=st.epoch,
                       val_acc=res.acc if res else None, val_loss=res.loss if res else None,
                       registered_version=version, checkpoint=str(s.ckpt_path),
                       run_dir=str(s.run_dir), exit_code=exit_code)
        if s.mlrun is not None:
            s.mlrun.end("KILLED" if status == RunStatus.interrupted else "FINISHED")
        log.info("run %s %s at step %d%s", s.run_name, status, st.step,
                 "" if res is None else f" (val_acc {res.acc:.4f})" if res.acc is not None
                 else f" (val_loss {res.loss:.4f})")
        return TrainResult(status, st.step, st.epoch, s.run_name, s.run_dir,
                           res.acc if res else None, res.loss if res else None, run_id, version,
                           s.ckpt_path, exit_code)

