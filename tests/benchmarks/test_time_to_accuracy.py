"""The time-to-accuracy table and plot from a results file (benchmarks/time_to_accuracy.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


def _plot(tmp_path: Path, rows: list[dict], *args: str) -> subprocess.CompletedProcess[str]:
    """``time_to_accuracy.py plot`` over ``rows`` as a results file, drawing tmp_path/p.png."""
    results = tmp_path / "r.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return subprocess.run([sys.executable, "benchmarks/time_to_accuracy.py", "plot", *args,
                           "--results", str(results), "--out", str(tmp_path / "p.png")],
                          capture_output=True, text=True, timeout=120)


def test_plot_and_table_from_results(tmp_path: Path) -> None:
    rows = [{"recipe": "r", "budget_minutes": b, "seed": s, "val_acc": acc, "steps": st,
             "wall_s": 60 * b - 5, "load_before": 0.1, "load_after": 2.0, "cpu": "CPU X",
             "cores": 2}
            for b, s, acc, st in ((5, 0, 0.70, 100), (5, 1, 0.72, 110), (10, 0, 0.80, 200))]
    # history that must stay out of the table and the plot (e.g. a slower machine's run)
    rows.append({**rows[2], "seed": 1, "val_acc": 0.10, "superseded": "a slower machine"})
    proc = _plot(tmp_path, rows, "--recipes", "r")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = proc.stdout.splitlines()  # the recipe's name, a blank line, then its table
    assert lines[0] == "`r`" and lines[2].startswith("| budget |")
    # steps/s over the wall time: 100 / 295 and 110 / 295 -> 0.36; 200 / 595 -> 0.34
    assert lines[4].startswith("| 5 min | 2 | 70.00 / 72.00 % | **71.00 %** | 105 | 0.4 |")
    assert lines[5].startswith("| 10 min | 1 | 80.00 % | **80.00 %** | 200 | 0.3 |")
    assert len(lines) == 6


def test_cpus_with_and_without_native_bf16_form_separate_tables(tmp_path: Path) -> None:
    """A recipe's rows from a CPU without native bf16 (several times slower) are not averaged
    with those of a CPU with it: one table and one line each, named by the kind."""
    base = {"recipe": "r", "budget_minutes": 30, "wall_s": 1795, "load_before": 0.1,
            "load_after": 2.0, "cores": 2}
    rows = [{**base, "seed": 0, "val_acc": 0.83, "steps": 16000, "cpu": "EPYC A",
             "native_bf16": True, "avx512_bf16": True, "amx": False},
            {**base, "seed": 1, "val_acc": 0.81, "steps": 15000, "cpu": "EPYC A",
             "native_bf16": True, "avx512_bf16": True, "amx": False},
            {**base, "seed": 0, "val_acc": 0.72, "steps": 2600, "cpu": "EPYC B",
             "native_bf16": False, "avx512_bf16": False, "amx": False}]
    proc = _plot(tmp_path, rows)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "`r` (AVX-512 BF16)" in text and "`r` (no native bf16)" in text
    assert "| 30 min | 2 | 83.00 / 81.00 % | **82.00 %** |" in text
    assert "| 30 min | 1 | 72.00 % | **72.00 %** |" in text


def test_a_results_line_records_the_cpus_bf16_flags() -> None:
    from benchmarks.time_to_accuracy import _machine, machine_kind
    from vit_service.hardware import cpu_flags, cpu_has_native_bf16, cpu_model

    m = _machine()
    assert m["cpu"] == cpu_model() and m["native_bf16"] is cpu_has_native_bf16()
    assert set(m) == {"cpu", "native_bf16", "avx512", "avx512_bf16", "amx"}
    assert m["avx512"] is ("avx512f" in cpu_flags())
    assert machine_kind({"native_bf16": False, "amx": False}) == "no native bf16"
    # an fp32 step with and without AVX-512: separate kinds, never one mean
    assert machine_kind({"native_bf16": False, "avx512": True}) == "no native bf16, AVX-512"
    assert machine_kind({"native_bf16": False, "avx512": False}) == "no native bf16, no AVX-512"
    assert machine_kind({"native_bf16": True, "amx": False}) == "AVX-512 BF16"
    assert machine_kind({"native_bf16": True, "amx": True}) == "AMX"
    assert machine_kind({"cpu": "x"}) == "unknown"  # a line from before the field


def test_plot_refuses_a_recipe_without_results(tmp_path: Path) -> None:
    row = {"recipe": "r", "budget_minutes": 5, "seed": 0, "val_acc": 0.7, "steps": 100,
           "wall_s": 295, "load_before": 0.1, "load_after": 2.0, "cores": 2}
    proc = _plot(tmp_path, [row], "--recipes", "r", "typo")
    assert proc.returncode != 0 and "no results for typo" in proc.stderr
    assert not (tmp_path / "p.png").exists()


def test_plot_logs_to_the_projects_tracking_store(tmp_path: Path) -> None:
    """``--log-to-mlflow`` writes to the home's store (what the MLflow UI shows), not to a
    database in the working directory."""
    import os

    import mlflow

    row = {"recipe": "r", "budget_minutes": 5, "seed": 0, "val_acc": 0.7, "steps": 100,
           "wall_s": 295, "load_before": 0.1, "load_after": 2.0, "cpu": "CPU X", "cores": 2}
    results = tmp_path / "r.jsonl"
    results.write_text(json.dumps(row) + "\n")
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    script = Path("benchmarks/time_to_accuracy.py").resolve()
    env = {**os.environ, "VIT_SERVICE_HOME": str(home), "PYTHONPATH": str(Path.cwd())}
    env.pop("VIT_SERVICE_TRACKING_URI", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run([sys.executable, str(script), "plot", "--results", str(results),
                           "--out", str(tmp_path / "p.png"), "--log-to-mlflow"],
                          capture_output=True, text=True, timeout=300, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr
    assert not (cwd / "mlflow.db").exists() and not (cwd / "mlruns").exists()
    client = mlflow.MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    exp = client.get_experiment_by_name("benchmarks")
    assert exp is not None
    (run,) = client.search_runs([exp.experiment_id])
    # named by the recipe and the kind of CPU (this row predates the flag: unknown)
    assert abs(run.data.metrics["r.unknown.val_acc_mean_5min"] - 0.7) < 1e-9
    # the PNG and the table went to the home's artifact folder
    assert run.info.artifact_uri.startswith((home / "mlartifacts").resolve().as_uri())
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {
        "p.png", "time_to_accuracy.md"}


def test_an_earlier_form_of_the_recipe_gets_its_own_line_and_table(tmp_path: Path) -> None:
    """Lines measured with a former form of the recipe (``recipe_state``) are not averaged
    with those of the recipe as shipped."""
    base = {"recipe": "r", "budget_minutes": 30, "wall_s": 1795, "load_before": 0.1,
            "load_after": 2.0, "cores": 2, "cpu": "EPYC A", "native_bf16": True, "amx": False}
    rows = [{**base, "seed": 0, "val_acc": 0.80, "steps": 16000},
            {**base, "seed": 1, "val_acc": 0.82, "steps": 16000},
            {**base, "seed": 0, "val_acc": 0.70, "steps": 9000, "recipe_state": "AdamW until X"}]
    proc = _plot(tmp_path, rows)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "`r`\n" in text and "`r` (AdamW until X)" in text
    assert "| 30 min | 2 | 80.00 / 82.00 % | **81.00 %** |" in text
    assert "| 30 min | 1 | 70.00 % | **70.00 %** |" in text


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A private home and SQLite tracking store, set for this process and undone after
    (MLflow's process-wide tracking URI and the cached settings included)."""
    import mlflow

    from vit_service import tracking
    from vit_service.config import get_settings

    home = tmp_path / "home"
    uri = f"sqlite:///{home / 'mlflow.db'}"
    monkeypatch.setenv("VIT_SERVICE_HOME", str(home))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    get_settings.cache_clear()
    try:
        tracking.configure(uri)
        yield uri
    finally:
        mlflow.set_tracking_uri(None)
        get_settings.cache_clear()


def test_add_takes_only_finished_runs_of_the_recipe_as_shipped(
        tmp_path: Path, store: str) -> None:
    """``add`` turns a ``vit-service train`` run into a results line when its logged recipe
    is the shipped one at its budget and seed (the description may differ); a run with any
    other setting (here the former learning rate, or a field the recipe does not have) is
    refused and nothing is appended, not even the good run beside it; no run goes in twice."""
    import mlflow

    from benchmarks.time_to_accuracy import _table, main
    from training.recipes import load_recipe
    from training.reporting import recipe_params
    from vit_service import tracking

    client = mlflow.MlflowClient(store)
    exp = tracking.ensure_experiment("cifar10")
    shipped = recipe_params(load_recipe("cifar10-vit-cpu", {"budget_minutes": 5, "seed": 1}))
    machine = {"machine.cpu": "CPU X", "machine.native_bf16": "True", "machine.avx512": "True",
               "machine.avx512_bf16": "True", "machine.amx": "False", "machine.cpu_count": "2"}

    def logged(name: str, params: dict[str, str], status: str = "FINISHED") -> str:
        rid = client.create_run(exp, run_name=name).info.run_id
        for k, v in {**params, **machine}.items():
            client.log_param(rid, k, v)
        for k, v in {"val_acc": 0.7, "budget/steps": 2883, "budget/wall_s": 289.64}.items():
            client.log_metric(rid, k, v, step=2883)
        client.set_terminated(rid, status)
        return rid

    good = logged("good", {**shipped, "recipe.description": "an older wording",
                           "budget_underrun_reason": "the last validation and publishing took"})
    # the recipe's 0.0 given on the command line as 0: the same value, so the same recipe
    zero = logged("zero", {**shipped, "recipe.model.overrides.drop_path_rate": "0"})
    former = logged("former", {**shipped, "recipe.optim.lr": "0.002"})
    extra = logged("extra", {**shipped, "recipe.optim.nesterov": "True"})
    killed = logged("killed", shipped, status="KILLED")
    results = tmp_path / "r" / "r.jsonl"

    def add(*ids: str, loads: tuple[str, ...] = ()) -> None:
        main(["add", *ids, "--recipe", "cifar10-vit-cpu", "--results", str(results),
              *(["--loads", *loads] if loads else [])])

    for ids, why in (((good, former), "recipe.optim.lr was '0.002', is now '0.0003'"),
                     ((extra,), "recipe.optim.nesterov was 'True', is now None"),
                     ((killed,), "is KILLED, not FINISHED"),
                     (("0123abc",), "no run 0123abc in sqlite"),
                     ((good, good), f"given twice: {good}")):
        with pytest.raises(SystemExit, match=re.escape(why)):
            add(*ids)
        assert not results.exists()
    with pytest.raises(SystemExit, match="1 --loads for 2 runs"):
        add(good, former, loads=("0.5,2.0",))
    add(good, loads=("0.5,2.0",))
    with pytest.raises(SystemExit, match=f"already in {re.escape(str(results))}"):
        add(good)
    add(zero)
    row, row_zero = [json.loads(x) for x in results.read_text().splitlines()]
    assert row_zero["mlflow_run_id"] == zero
    assert {k: row[k] for k in ("recipe", "budget_minutes", "seed", "val_acc", "steps",
                                "wall_s", "load_before", "load_after", "cpu", "native_bf16",
                                "avx512", "amx", "cores", "mlflow_run_id", "underrun")} == {
        "recipe": "cifar10-vit-cpu", "budget_minutes": 5.0, "seed": 1, "val_acc": 0.7,
        "steps": 2883, "wall_s": 289.6, "load_before": 0.5, "load_after": 2.0, "cpu": "CPU X",
        "native_bf16": True, "avx512": True, "amx": False, "cores": 2, "mlflow_run_id": good,
        "underrun": "the last validation and publishing took"}
    assert "'good'" in row["added_from"]
    # a line without loads (none measured) still makes a table row
    unmeasured = {**row, "load_before": None, "load_after": None}
    assert _table([unmeasured]).splitlines()[2].endswith("| not recorded |")
    assert _table([row]).splitlines()[2].endswith("| 0.5-2.0 |")


@pytest.mark.parametrize(("a", "b", "same"), [
    ("0", "0.0", True), ("2", "2", True), ("[0.9, 0.999]", "[0.9,0.999]", True),
    ("[[0.5, 16]]", "[[0.5, 16.0]]", True), ("null", "null", True), ("mean", "mean", True),
    ("0.1", "0.0", False), ("True", "1", False), ("mean", "cls", False), (None, "0", False),
    ("[[0.5, 16]]", "[[0.5, 24]]", False), ("null", "0", False)])
def test_add_compares_logged_params_as_the_values_they_spell(
        a: str | None, b: str | None, same: bool) -> None:
    from benchmarks.time_to_accuracy import same_param

    assert same_param(a, b) is same
    assert same_param(b, a) is same
