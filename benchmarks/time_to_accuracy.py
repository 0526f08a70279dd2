"""Time to accuracy: one recipe family whose only difference is ``budget_minutes``.

Each run is the shipped recipe (``cifar10-vit-convstem-cpu`` by default: its schedule,
resolution phases and evaluation are sized by the budget) trained to the end of its budget, one
at a time, on an otherwise idle machine::

    python benchmarks/time_to_accuracy.py run --budgets 5 10 30 60 --seeds 0 1 \\
        --data-dir ../shared/data --results benchmarks/results/time_to_accuracy.jsonl
    python benchmarks/time_to_accuracy.py plot \\
        --results benchmarks/results/time_to_accuracy.jsonl \\
        --out docs/img/time_to_accuracy.png --log-to-mlflow

``run`` appends one JSON line per run (budget, seed, validation accuracy, wall time, steps,
the load average before and after, the CPU and whether it has native bf16); ``plot`` draws
accuracy against minutes for each recipe and kind of CPU in the results (each seed a point,
the mean a line), prints the markdown tables docs/benchmarks.md carries and,
with ``--log-to-mlflow``, logs the PNG and the table to an MLflow run of the ``benchmarks``
experiment.

The same cloud machine has run the same step at different speeds on different days, so the
table shows each row's updates per second. CPUs with and without native bf16 (AVX-512 BF16 /
AMX) train the recipes at several times different speeds, so their rows form separate lines
and tables, never one mean. A line with a ``superseded`` field (why: e.g.
measured while the machine ran at half the updates per second of the other rows) stays in the
file as history but out of the plot and the table. A line measured with an earlier form of
the recipe names that form (``recipe_state``, e.g. its former optimizer) and gets a line and a
table of its own beside the recipe as shipped (the lines without the field).

A run made with ``vit-service train`` outside ``run`` (an ablation's run with exactly the
settings the recipe later shipped) joins the family with ``add RUN_ID ... --recipe R
[--loads BEFORE,AFTER ...]``: its logged ``recipe.*`` params must equal the shipped recipe's at
its budget and seed (any other difference is refused, naming the field), and the line says so
(``added_from``) and takes the wall time from the run's ``budget/wall_s``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from training.launch import cores
from vit_service.hardware import machine_params

log = logging.getLogger("time_to_accuracy")
RECIPE = "cifar10-vit-convstem-cpu"


def _machine() -> dict[str, Any]:
    """This CPU as a results line records it: ``cpu`` (its model), ``native_bf16``,
    ``avx512``, ``avx512_bf16``, ``amx`` (the run's ``machine.*`` MLflow params, unprefixed)."""
    m = {k.removeprefix("machine."): v for k, v in machine_params().items()}
    return {"cpu": m["cpu"], "native_bf16": m["native_bf16"], "avx512": m["avx512"],
            "avx512_bf16": m["avx512_bf16"], "amx": m["amx"]}


def machine_kind(row: dict[str, Any]) -> str:
    """The kind of CPU a results line ran on, as the table and the plot group rows: native
    bf16 (AMX or AVX-512 BF16) or not, and without it AVX-512 or not, since the fp32 step the
    recipes fall back to runs at different speeds on those (a line written before a field was
    recorded says ``unknown``, or leaves the AVX-512 part out)."""
    if "native_bf16" not in row:
        return "unknown"
    if row["native_bf16"]:
        return "AMX" if row.get("amx") else "AVX-512 BF16"
    if "avx512" not in row:
        return "no native bf16"
    return "no native bf16, AVX-512" if row["avx512"] else "no native bf16, no AVX-512"


def _end_event(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{") and '"event": "end"' in line:
            return json.loads(line)
    raise RuntimeError("the run printed no end event")


def run(args: argparse.Namespace) -> None:
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    for budget in args.budgets:
        for seed in args.seeds:
            cmd = [sys.executable, "-m", "vit_service.cli", "train", args.recipe,
                   "--data-dir", args.data_dir, "--run-name",
                   # the recipe in the name keeps two recipes' run folders apart
                   f"tta-{args.recipe}-{budget:g}m-s{seed}",
                   "--set", f"budget_minutes={budget:g}", "--set", f"seed={seed}"]
            if not args.register:
                cmd.append("--no-register")
            load0 = os.getloadavg()[0]
            t0 = time.monotonic()
            log.info("budget %g min, seed %d: %s", budget, seed, " ".join(cmd))
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            wall = time.monotonic() - t0
            if proc.returncode != 0:
                raise SystemExit(f"run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            end = _end_event(proc.stdout)
            rec = {"recipe": args.recipe, "budget_minutes": budget, "seed": seed,
                   "val_acc": end.get("val_acc"), "steps": end.get("step"),
                   "wall_s": round(wall, 1), "load_before": round(load0, 2),
                   "load_after": round(os.getloadavg()[0], 2), **_machine(),
                   "cores": cores(),
                   "mlflow_run_id": end.get("mlflow_run_id"),
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
            log.info("-> %s", rec)
            with results.open("a") as f:
                f.write(json.dumps(rec) + "\n")


# what may differ between a logged run and the recipe as shipped: the family's two variables,
# and fields that do not change training
FREE_PARAMS = frozenset({"recipe.budget_minutes", "recipe.seed", "recipe.description",
                         "recipe.register_as"})


def _param_value(s: str) -> Any:
    """A logged param as the value it spells, read as the recipe reads a ``--set`` value
    (``0`` and ``0.0`` alike, as a free-form field such as model.overrides may be given either
    way; ``null`` as None); booleans tagged, as Python's ``True == 1``."""
    from training.recipes import parse_value

    def norm(v: Any) -> Any:
        if isinstance(v, bool):
            return ("bool", v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v
    return norm(parse_value(s))


def same_param(a: str | None, b: str | None) -> bool:
    """Whether two logged params (MLflow's strings, or None for absent) spell one value."""
    if a is None or b is None:
        return a is b
    return a == b or _param_value(a) == _param_value(b)


def results_line(run: Any, recipe: str, loads: tuple[float, float] | None) -> dict[str, Any]:
    """The results line of a finished MLflow run (an ``mlflow.entities.Run``) of ``recipe``
    trained with ``vit-service train``, or SystemExit saying why it is not a run of the family:
    every ``recipe.*`` param must equal the recipe as shipped now, at the run's budget and
    seed. The CPU fields come from the run's ``machine.*`` params, the wall time from its
    ``budget/wall_s``; ``loads`` (before, after) only where the caller measured them."""
    from training.recipes import RecipeError, load_recipe
    from training.reporting import recipe_params

    p, m, name = run.data.params, run.data.metrics, run.info.run_name
    if run.info.status != "FINISHED":
        raise SystemExit(f"run {name} ({run.info.run_id}) is {run.info.status}, not FINISHED")
    if p.get("recipe.name") != recipe:
        raise SystemExit(f"run {name} trained {p.get('recipe.name')!r}, not {recipe!r}")
    if p.get("recipe.budget_minutes", "null") == "null":
        raise SystemExit(f"run {name} had no budget_minutes: not a run of the family")
    try:
        budget, seed = float(p["recipe.budget_minutes"]), int(p["recipe.seed"])
        shipped = recipe_params(load_recipe(recipe, {"budget_minutes": budget, "seed": seed}))
    except (KeyError, ValueError) as e:  # RecipeError is a ValueError
        why = e if isinstance(e, RecipeError) else f"bad or missing param {e}"
        raise SystemExit(f"run {name}: {why}") from None
    logged = {k: v for k, v in p.items() if k.startswith("recipe.")}
    differ = sorted(k for k in shipped.keys() | logged.keys()
                    if k not in FREE_PARAMS and not same_param(shipped.get(k), logged.get(k)))
    if differ:
        raise SystemExit(f"run {name} is not {recipe} as shipped: " + "; ".join(
            f"{k} was {logged.get(k)!r}, is now {shipped.get(k)!r}" for k in differ))
    missing = {"val_acc", "budget/steps", "budget/wall_s"} - m.keys()
    if missing:
        raise SystemExit(f"run {name} logged no {', '.join(sorted(missing))}")
    cores_ = p.get("machine.cpu_count")
    line = {"recipe": recipe, "budget_minutes": budget, "seed": seed,
            "val_acc": m["val_acc"], "steps": int(m["budget/steps"]),
            "wall_s": round(m["budget/wall_s"], 1),
            "load_before": loads[0] if loads else None,
            "load_after": loads[1] if loads else None,
            "cpu": p.get("machine.cpu"), "native_bf16": p.get("machine.native_bf16") == "True",
            "avx512_bf16": p.get("machine.avx512_bf16") == "True",
            **({"avx512": p["machine.avx512"] == "True"} if "machine.avx512" in p else {}),
            "amx": p.get("machine.amx") == "True",
            # the machine's count (os.cpu_count), where `run` records the affinity's
            "cores": int(cores_) if cores_ else None,
            "mlflow_run_id": run.info.run_id,
            # the end, as `run` dates its lines
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(run.info.end_time / 1000)),
            "added_from": f"`vit-service train` run {name!r}, added with `add`"}
    if "budget_underrun_reason" in p:  # it ended before its budget: the line says why
        line["underrun"] = p["budget_underrun_reason"]
    return line


def _get_run(client: Any, run_id: str) -> Any:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id)
    except MlflowException as e:
        raise SystemExit(f"no run {run_id} in {client.tracking_uri}: {e.message}") from None


def add(args: argparse.Namespace) -> None:
    """Append the results lines of finished runs made outside ``run`` (e.g. an ablation's
    runs with exactly the settings the recipe later shipped); all or none."""
    from mlflow import MlflowClient

    from vit_service import tracking

    loads: list[tuple[float, float] | None] = [None] * len(args.run_ids)
    if args.loads:
        if len(args.loads) != len(args.run_ids):
            raise SystemExit(f"{len(args.loads)} --loads for {len(args.run_ids)} runs")
        try:
            loads = [(float(b), float(a)) for b, a in (x.split(",") for x in args.loads)]
        except ValueError as e:
            raise SystemExit(f"--loads takes BEFORE,AFTER per run: {e}") from None
    results = Path(args.results)
    known = {json.loads(x).get("mlflow_run_id") for x in
             (results.read_text().splitlines() if results.exists() else []) if x.strip()}
    again = sorted({r for r in args.run_ids if r in known or args.run_ids.count(r) > 1})
    if again:  # a line twice would count as two seeds
        raise SystemExit(f"already in {results} or given twice: {', '.join(again)}")
    tracking.configure()
    client = MlflowClient()
    lines = [results_line(_get_run(client, r), args.recipe, ld)
             for r, ld in zip(args.run_ids, loads, strict=True)]
    results.parent.mkdir(parents=True, exist_ok=True)
    with results.open("a") as f:
        for rec in lines:
            log.info("-> %s", rec)
            f.write(json.dumps(rec) + "\n")


def _table(rows: list[dict[str, Any]]) -> str:
    by: dict[float, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by[float(r["budget_minutes"])].append(r)
    out = ["| budget | seeds | val acc (each) | mean | steps (mean) | steps/s (mean) "
           "| wall (mean) | load |",
           "|---:|---:|---|---:|---:|---:|---:|---|"]
    for b in sorted(by):
        rs = sorted(by[b], key=lambda r: r["seed"])
        accs = [100 * r["val_acc"] for r in rs]
        before = [r["load_before"] for r in rs if r.get("load_before") is not None]
        after = [r["load_after"] for r in rs if r.get("load_after") is not None]
        # a line added from a run nobody measured the load of has none
        loads = f"{min(before):.1f}-{max(after):.1f}" if before and after else "not recorded"
        # over the whole wall time (loading, evaluations, the end): the machine's speed
        rate = statistics.mean(r["steps"] / r["wall_s"] for r in rs)
        out.append(
            f"| {b:g} min | {len(rs)} | {' / '.join(f'{a:.2f}' for a in accs)} % | "
            f"**{statistics.mean(accs):.2f} %** | {statistics.mean(r['steps'] for r in rs):,.0f}"
            f" | {rate:.1f} | {statistics.mean(r['wall_s'] for r in rs) / 60:.1f} min "
            f"| {loads} |")
    return "\n".join(out)


def _current(lines: list[str]) -> list[dict[str, Any]]:
    """The results' rows less the superseded ones (kept in the file as history)."""
    rows = [json.loads(line) for line in lines if line.strip()]
    return [r for r in rows if not r.get("superseded")]


def plot(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = _current(Path(args.results).read_text().splitlines())
    recipes = args.recipes or sorted({r["recipe"] for r in every})
    missing = sorted(set(recipes) - {r["recipe"] for r in every})
    if missing:  # a typo would otherwise draw an empty plot over the docs' one
        raise SystemExit(f"no results for {', '.join(missing)} in {args.results}")
    shown = [r for r in every if r["recipe"] in recipes]
    # one line and one table per recipe, form of it, and kind of CPU: their speeds differ
    # several-fold
    def group(r: dict[str, Any]) -> tuple[str, str, str]:
        return r["recipe"], r.get("recipe_state", ""), machine_kind(r)

    groups = sorted({group(r) for r in shown}, key=lambda g: (recipes.index(g[0]), g[1], g[2]))
    several = len({kind for _, _, kind in groups}) > 1
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    tables, means = [], {}
    colors = itertools.cycle(("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple",
                              "tab:brown", "tab:pink", "tab:gray"))
    for (recipe, state, kind), color in zip(groups, colors, strict=False):  # colours cycle
        rows = [r for r in shown if group(r) == (recipe, state, kind)]
        label = ", ".join(x for x in (state, kind if several else "") if x)
        name = f"{recipe}, {label}" if label else recipe
        by: dict[float, list[float]] = defaultdict(list)
        for r in rows:
            by[float(r["budget_minutes"])].append(100 * r["val_acc"])
        budgets = sorted(by)
        for b in budgets:
            ax.scatter([b] * len(by[b]), by[b], color=color, alpha=0.6, s=18)
        # a recipe's former forms dashed, so that the recipes as shipped stand out
        ax.plot(budgets, [statistics.mean(by[b]) for b in budgets], "--o" if state else "-o",
                color=color, alpha=0.6 if state else 1.0, label=name)
        tables.append(f"`{recipe}`{f' ({label})' if label else ''}\n\n{_table(rows)}")
        means[(recipe, state, kind)] = {b: statistics.mean(by[b]) for b in budgets}
    ticks = sorted({b for m in means.values() for b in m})
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(ticks, [f"{b:g}" for b in ticks])
    ax.set_xlabel("training budget, minutes (whole run: data, training, evaluation)")
    ax.set_ylabel("CIFAR-10 validation accuracy, %")
    cpus = sorted({str(r.get("cpu", "?")) for r in shown})
    cores_ = sorted({str(r.get("cores", "?")) for r in shown})
    ax.set_title(f"Time to accuracy on {' / '.join(cpus)}, {' / '.join(cores_)} cores "
                 "(points: seeds; lines: their mean; dashed: a recipe's former form)", fontsize=8)
    ax.grid(alpha=0.3)
    # below the axes: the labels of former forms are long and would cover the points
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.14))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight")
    table = "\n\n".join(tables)
    print(table)
    log.info("wrote %s", out)
    if args.log_to_mlflow:
        import mlflow

        from vit_service import tracking

        # the project's tracking store and artifact folder (what `vit-service up` and the
        # MLflow UI show), not MLflow's defaults of a database and ./mlruns in the working
        # directory
        tracking.configure()
        experiment_id = tracking.ensure_experiment("benchmarks")
        with mlflow.start_run(experiment_id=experiment_id, run_name="time-to-accuracy"):
            mlflow.log_artifact(str(out))
            mlflow.log_text(table, "time_to_accuracy.md")
            for (recipe, state, kind), m in means.items():
                # the kind always in the name: a metric keeps its name across benchmark runs
                key = ".".join(re.sub(r"[^\w.\-/]", "_", x) for x in (recipe, state, kind) if x)
                for b, acc in m.items():
                    mlflow.log_metric(f"{key}.val_acc_mean_{b:g}min", acc / 100)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train the recipe at each budget and seed, one at a time")
    r.add_argument("--budgets", type=float, nargs="+", default=[5, 10, 30, 60])
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    r.add_argument("--data-dir", required=True)
    r.add_argument("--register", action="store_true", help="register each run's model")
    q = sub.add_parser("plot", help="the plot and the table from the results")
    q.add_argument("--out", default="docs/img/time_to_accuracy.png")
    q.add_argument("--log-to-mlflow", action="store_true")
    a = sub.add_parser("add", help="append the lines of finished `vit-service train` runs of "
                       "the recipe as shipped, by MLflow run id")
    a.add_argument("run_ids", nargs="+")
    a.add_argument("--loads", nargs="+", metavar="BEFORE,AFTER",
                   help="the load average before and after each run, in the same order")
    for s in (r, a):
        s.add_argument("--recipe", default=RECIPE)
    q.add_argument("--recipes", nargs="+", help="the recipes to draw (default: every one)")
    for s in (r, q, a):
        s.add_argument("--results", default="benchmarks/results/time_to_accuracy.jsonl")
    args = p.parse_args(argv)
    {"run": run, "plot": plot, "add": add}[args.cmd](args)


if __name__ == "__main__":
    main()
