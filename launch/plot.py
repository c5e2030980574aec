"""Pictures of runs: ``report.png`` at the end of every run, and several runs overlaid.

::

    python -m cp_rope.launch.plot runs/pretrain_cpu_20261201_220000            # -> RUN/report.png
    python -m cp_rope.launch.plot runs/a runs/b --out compare.png               # overlay

Reads each run's ``metrics.jsonl`` (a run still in progress too: a half-written last line
is skipped) and draws, over optimizer steps: the loss (each logged step and a centred moving
average), bits per byte (training: over each log window; held-out as markers), the learning rate, tokens/s
per GPU, peak memory, MFU (GPU runs) and, for CP runs, each rank's share of the attention
work of the batches it saw (``cp_work``: 1.0 = the group's mean). Needs matplotlib
(``pip install -e ".[plot]"``, which ``scripts/setup.sh`` does); the trainer without it
prints one line saying so and carries on. Agg backend: no display needed.
"""

from __future__ import annotations

import argparse
import json
import math
import os

__all__ = ["load_metrics", "make_figure", "plot_runs", "write_report", "main"]

_PANELS = (  # (title, y label, training key, held-out key)
    ("loss", "loss (nats / token)", "loss", "eval_loss"),
    ("bits per byte", "bits / byte", "bpb", "eval_bpb"),
    ("learning rate", "learning rate", "lr", None),
    ("throughput", "tokens / s per GPU (CPU: per process)", "tokens_per_s_per_gpu", None),
    ("peak memory", "peak memory (GiB)", "peak_mem_gib", None),
    ("MFU", "MFU (%)", "mfu", None),
    ("gradient norm", "gradient L2 norm", "grad_norm", None),
    ("CP balance", "attention work / group mean", "cp_work", None),
)
HINT = ('pip install matplotlib (or pip install -e ".[plot]") for report.png, then '
        "python -m cp_rope.launch.plot {run}")


def load_metrics(run_dir: str) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl``, in file order; lines that are not a JSON
    object with an integer ``step`` (a last line being written) are skipped.

    Raises: FileNotFoundError naming ``run_dir`` when there is no metrics.jsonl; ValueError
    naming it when the file holds no record.
    """
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"run_dir={run_dir!r}: no metrics.jsonl there (not a cp-rope "
                                "run directory, or the run has not logged a step yet)")
    records, unreadable = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                unreadable += 1
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                records.append(rec)
    if not records and unreadable > 1:  # more than a last line being written: damage
        raise ValueError(f"run_dir={run_dir!r}: metrics.jsonl: {unreadable} lines are not JSON "
                         "records (the file is damaged, or not a cp-rope metrics file)")
    if not records:
        raise ValueError(f"run_dir={run_dir!r}: metrics.jsonl holds no step record yet")
    return records


def _series(records: list[dict], key: str) -> tuple[list[int], list]:
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    if key != "cp_work":
        pts = [(s, v) for s, v in pts if isinstance(v, (int, float)) and math.isfinite(v)]
    return [s for s, _ in pts], [v for _, v in pts]


def _moving_average(values: list[float], k: int) -> list[float]:
    """Centred mean over ``k`` points (odd; fewer at the ends): smooth, without an EMA's lag."""
    h = k // 2
    return [sum(values[max(0, i - h):i + h + 1]) / len(values[max(0, i - h):i + h + 1])
            for i in range(len(values))]


def plot_runs(run_dirs: list[str], out: str | None = None, labels: list[str] | None = None) -> str:
    """Draw the runs' metrics (:func:`make_figure`) into one PNG; returns its path.

    Args:
        run_dirs: run directories (each with a metrics.jsonl).
        out: the PNG; default ``run_dirs[0]/report.png`` for one run, ``./runs_compare.png``
            for several.
        labels: legend names (default: the directories' names).

    Raises: as :func:`make_figure`.
    """
    out = out or (os.path.join(run_dirs[0], "report.png") if len(run_dirs) == 1
                  else "runs_compare.png")
    if os.path.isdir(out):
        raise ValueError(f"out={out!r} is a directory: give the PNG's file name")
    if not os.path.splitext(out)[1]:  # matplotlib would append .png: say so in the path returned
        out += ".png"
    fig = make_figure(run_dirs, labels)
    fig.savefig(out, dpi=80)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return out


def make_figure(run_dirs: list[str], labels: list[str] | None = None):
    """The matplotlib Figure of the runs: 2 x 4 panels (see the module docstring), steps on x.

    Raises: FileNotFoundError / ValueError naming a directory without metrics
    (:func:`load_metrics`); ModuleNotFoundError without matplotlib; ValueError for
    ``labels`` of another length or no run.
    """
    if not run_dirs:
        raise ValueError("run_dirs: give at least one run directory")
    labels = labels or [os.path.basename(os.path.normpath(d)) or d for d in run_dirs]
    if len(labels) != len(run_dirs):
        raise ValueError(f"labels: {len(labels)} names for {len(run_dirs)} runs")
    runs = [load_metrics(d) for d in run_dirs]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(17, 7.5), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, ylabel, key, held_key) in zip(axes.flat, _PANELS, strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        drawn = False
        for i, (recs, name) in enumerate(zip(runs, labels, strict=True)):
            color = colors[i % len(colors)]
            steps, values = _series(recs, key)
            if key == "cp_work":
                drawn |= _draw_balance(ax, steps, values, name if len(runs) > 1 else "", color)
                continue
            if key == "mfu":
                values = [100 * v for v in values]
            prefix = f"{name} " if len(runs) > 1 else ""
            if values:
                drawn = True
                smooth = key == "loss" and len(values) > 4  # bpb: already over each log window
                ax.plot(steps, values, color=color, alpha=0.35 if smooth else 1.0,
                        lw=1 if smooth else 1.5, label=name if not held_key else
                        f"{prefix}train" + (" (each log window)" if key == "bpb" else ""))
                if smooth:
                    k = max(3, len(values) // 6 | 1)
                    ax.plot(steps, _moving_average(values, k), color=color, lw=2,
                            label=f"{prefix}train, mean of {k} logged steps")
            if held_key:
                hs, hv = _series(recs, held_key)
                if hv:
                    drawn = True
                    ax.plot(hs, hv, "o--", color=color, ms=6, lw=1.2, mfc="white",
                            label=f"{prefix}held-out")
        if key == "lr" and drawn:
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        if key in ("peak_mem_gib", "tokens_per_s_per_gpu", "lr") and drawn:
            ax.set_ylim(bottom=0)
        if drawn and (len(runs) > 1 or held_key or key == "cp_work"):
            ax.legend(fontsize=8)
        if not drawn:
            why = {"mfu": "no MFU logged\n(device peak FLOP/s unknown:\nCPU, or --peak-tflops)",
                   "cp_work": "no CP balance logged (cp_size 1)", "bpb": "no bits per byte (.bin corpus)",
                   "eval_loss": ""}.get(key, "not logged")
            ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, fontsize=9,
                    color="gray", wrap=True)
    fig.suptitle(" vs ".join(labels) if len(runs) > 1 else f"run {labels[0]}")
    return fig


def _draw_balance(ax, steps, works, name: str, color) -> bool:
    """Each rank's work / the group mean per logged window: one line per rank."""
    if not works:
        return False
    n_ranks = len(works[0])
    lo, hi = 0.8, 1.2  # at least +-20%: a balanced run reads as a flat line at 1
    for r in range(n_ranks):
        share = [w[r] / (sum(w) / len(w)) if sum(w) > 0 else 1.0 for w in works]
        lo, hi = min(lo, *share), max(hi, *share)
        ax.plot(steps, share, lw=1.2, color=color if name else None, ls=("-", "--", ":", "-.")[r % 4],
                alpha=0.4 + 0.6 * (r + 1) / n_ranks, label=f"{name} rank {r}".strip())
    ax.set_ylim(min(lo, ax.get_ylim()[0]), max(hi, ax.get_ylim()[1]))
    return True


def write_report(run_dir: str, log=print) -> str | None:
    """``run_dir/report.png`` at the end of a run; never raises. Without matplotlib, ``log`` gets
    one line saying how to get the picture; returns the path or None."""
    try:
        path = plot_runs([run_dir])
    except ModuleNotFoundError as exc:
        if exc.name != "matplotlib":
            raise
        log("report: " + HINT.format(run=run_dir))
        return None
    except Exception as exc:  # a picture must never fail a finished run
        log(f"report: not drawn ({type(exc).__name__}: {exc})")
        return None
    log(f"report: {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m cp_rope.launch.plot RUN_DIR [RUN_DIR ...] [--out PNG] [--labels ...]``."""
    parser = argparse.ArgumentParser(prog="python -m cp_rope.launch.plot",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="run directories (each with a metrics.jsonl; a run in progress too)")
    parser.add_argument("--out", default=None, help="the PNG (default: RUN_DIR/report.png for "
                        "one run, ./runs_compare.png for several)")
    parser.add_argument("--labels", nargs="+", default=None, help="legend names, one per run")
    args = parser.parse_args(argv)
    try:
        path = plot_runs(args.run_dirs, args.out, args.labels)
    except ModuleNotFoundError as exc:
        if exc.name != "matplotlib":
            raise
        print("error: " + HINT.format(run=" ".join(args.run_dirs)))
        return 2
    except (FileNotFoundError, ValueError) as exc:
        parser.error(str(exc))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
