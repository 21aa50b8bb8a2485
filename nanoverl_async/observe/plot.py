"""One figure of one or more runs: `nanoverl-async plot RUN_DIR [RUN_DIR ...] [-o out.png]`.

    nanoverl-async plot outputs/agent_grpo                        # -> outputs/agent_grpo/plot.png
    nanoverl-async plot outputs/eta0 outputs/eta4 -o compare.png   # two runs overlaid

Reads each run directory's metrics.jsonl (one row per step, metrics.py) and config.yaml, and draws:

    reward vs step            | reward vs wall clock      every run overlaid, one colour per run; dashed with
                                                          squares: eval/reward_mean where run.eval_every evaluated
    generators gated          | generated tokens/s
    tool use                  | tool errors               (the episodes/tool_* keys of docs/metrics.md)
    staleness: <run 1>        | step time: <run 1>        one row per run: the share of the batch at each
    ...                                                   lag, as a heatmap; wait / train / publish, stacked
                                                          (a sweep of more than MAX_RUN_ROWS runs: none)

A run is labelled by the config keys whose values differ between the runs (`staleness.max=4`); a single
run, or runs whose configs match, by its directory name. Reading and the arrays each panel draws are
pure functions, tested without drawing; `draw` only draws, on matplotlib's Agg canvas directly (no
pyplot: no display, no global figure state). A run being written can be plotted: the line it is
writing is left out.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
from omegaconf import OmegaConf
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from nanoverl_async.checkpoint import changed_keys, claim
from nanoverl_async.config import ConfigError
from nanoverl_async.config_file import read_yaml
from nanoverl_async.observe.metrics import EVAL_KEY, current_rows

# keys that say where and how a run was started, not what it trained: they never label a run
UNLABELLED_KEYS = {"run.output_dir", "run.resume", "run.overwrite", "run.progress"}
MAX_RUN_ROWS = 4  # runs drawn with their own heatmap and time split; a larger sweep gets the overlays only
MAX_LABEL_KEYS = 4  # further differing keys are summarised as "+N more", so a legend stays readable
TIME_SPLIT = {"time/wait_batch_s": "wait for batch", "time/train_s": "train", "time/publish_s": "publish"}
TIME_COLOURS = ("#b0b0b0", "#4c72b0", "#dd8452")
TITLE_CHARS = 60  # a run row's title wraps here: two titles side by side fit the figure's width


class Overlay(NamedTuple):
    """One overlaid panel."""
    title: str
    x: str  # "step" or "wall_s"
    key: str  # the metrics key drawn (also the y label)
    x_label: str
    dashed: tuple[str, ...] = ()  # keys drawn dashed on the steps that have them


OVERLAYS = (Overlay("reward vs step", "step", "reward/mean", "step", (EVAL_KEY,)),
            Overlay("reward vs wall clock", "wall_s", "reward/mean", "training wall clock (s)", (EVAL_KEY,)),
            Overlay("generators gated", "step", "generators/gated_frac", "step"),
            Overlay("generated tokens/s", "step", "tokens/generated_per_s", "step"),
            Overlay("tool use: share of episodes with a tool call", "step", "episodes/tool_use_frac", "step"),
            Overlay("tool errors: failed calls / calls", "step", "episodes/tool_error_rate", "step"))


@dataclass
class Run:
    """A run directory as read: its metrics rows, in step order, and its resolved config."""

    path: Path
    rows: list[dict]
    config: dict


def read_run(run_dir: str) -> Run:
    """The run's metrics rows and its config.yaml as a plain nested dict (config_file.read_yaml, which reads every
    config file: a ConfigError naming the file when it is missing or not YAML)."""
    path = Path(run_dir)
    rows = read_rows(path / "metrics.jsonl")
    return Run(path, rows, OmegaConf.to_container(read_yaml(str(run_file(path / "config.yaml")))))


def run_file(path: Path) -> Path:
    """`path`, or a ConfigError naming it when it does not exist."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (a run directory holds the {path.name} a launch writes)")
    return path


def read_rows(path: Path) -> list[dict]:
    """metrics.jsonl's rows as written now (metrics.current_rows); a ConfigError naming the file when it is
    missing, empty or not JSON rows."""
    rows = []
    for number, line in enumerate(run_file(path).read_text().splitlines(keepends=True), 1):
        if not line.strip() or not line.endswith("\n"):  # blank, or the row a live run is still writing
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict) or "step" not in row:
            raise ConfigError(f"{path}:{number}: not a metrics row (a JSON object with a 'step')")
        rows.append(row)
    if not rows:
        raise ConfigError(f"{path}: no steps logged (the file is empty)")
    return current_rows(rows)  # an older run's rows as written now


def run_labels(configs: list[dict], names: list[str]) -> list[str]:
    """One legend label per run: `key=value` for each dotted config key whose value differs between the
    runs (`algorithm.correction=none, staleness.max=4`); the directory names for one run or equal configs."""
    differing = sorted({key for config in configs[1:] for key in changed_keys(configs[0], config)} - UNLABELLED_KEYS)
    if not differing:
        return list(names)
    more = f", +{len(differing) - MAX_LABEL_KEYS} more" if len(differing) > MAX_LABEL_KEYS else ""
    labels = [", ".join(f"{key}={config_value(config, key)}" for key in differing[:MAX_LABEL_KEYS]) + more
              for config in configs]
    if len(set(labels)) < len(labels):  # the shown keys agree, the rest differ: the names tell them apart
        labels = [f"{name}: {label}" for name, label in zip(names, labels)]
    return labels


def config_value(config: dict, key: str) -> str:
    """The value at a dotted key as an override would spell it (`false`, `null`, `[a, b]`), or "unset"
    where that config has no such key (a run written by a version without it)."""
    value = config
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return "unset"
        value = value[part]
    return value if isinstance(value, str) else json.dumps(value)


def column(rows: list[dict], key: str) -> np.ndarray:
    """One run's values of a metrics key, one per logged step; NaN where a row lacks the key."""
    return np.array([float(row.get(key, np.nan)) for row in rows])


def staleness_shares(rows: list[dict]) -> np.ndarray:
    """(lag, step) -> the share of that step's trajectories that were `lag` versions old (each column sums
    to 1, or is 0 for a step without a histogram). Lags run from 0 to the larger of the largest lag seen
    and the run's staleness/limit, so runs with the same limit are drawn on the same scale."""
    histograms = [{int(lag): count for lag, count in row.get("staleness/histogram", {}).items()} for row in rows]
    top = max([lag for histogram in histograms for lag in histogram]
              + [int(row.get("staleness/limit", 0)) for row in rows])
    shares = np.zeros((top + 1, len(rows)))
    for column, histogram in enumerate(histograms):
        total = sum(histogram.values())
        for lag, count in histogram.items():
            shares[lag, column] = count / total
    return shares


def draw(runs: list[Run]) -> Figure:
    """The figure: six overlaid panels on top, then one row per run (staleness heatmap, time split),
    unless there are more than MAX_RUN_ROWS runs (a sweep): then the overlays alone."""
    labels = run_labels([run.config for run in runs], [run.path.resolve().name for run in runs])
    rows = len(runs) if len(runs) <= MAX_RUN_ROWS else 0
    top = len(OVERLAYS) // 2
    figure = Figure(figsize=(13, 3.4 * (top + rows)), layout="constrained")
    FigureCanvasAgg(figure)  # the non-interactive Agg canvas: renders to PNG with no display
    axes = figure.subplots(top + rows, 2, squeeze=False)
    for ax in axes[top + 1:, 1]:
        ax.sharey(axes[top, 1])  # one seconds scale for every run's step time, so they compare by eye
    for ax, panel in zip(axes[:top].flat, OVERLAYS):
        draw_overlay(ax, panel, [run.rows for run in runs], labels)
    # one colour per run throughout: one legend, above the panels, as wide as the labels need
    figure.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside upper center", fontsize="small")
    for index, (run, label) in enumerate(zip(runs[:rows], labels)):
        draw_staleness(figure, axes[top + index, 0], run.rows, label, f"C{index}")
        draw_time_split(axes[top + index, 1], run.rows, label, f"C{index}")
    if rows:
        axes[top, 1].legend(fontsize="small", loc="upper right")  # the same three colours in every run's row
    return figure


def draw_overlay(ax, panel: Overlay, runs: list[list[dict]], labels: list[str]) -> None:
    """One OVERLAYS panel: each run's metrics rows, one line each, and its dashed key where rows have it (in the
    run's colour, out of the legend; named in the y label when drawn); x "wall_s" is the running sum of time/step_s."""
    x = panel.x
    key = panel.key
    dashed = panel.dashed
    drawn = set()
    for index, (rows, label) in enumerate(zip(runs, labels)):
        xs = np.cumsum(column(rows, "time/step_s")) if x == "wall_s" else column(rows, x)
        marker = "o" if len(rows) <= 30 else None  # a short run's steps stay visible as points
        ax.plot(xs, column(rows, key), color=f"C{index}", marker=marker, markersize=3, label=label)
        for other in dashed:
            ys = column(rows, other)
            kept = ~np.isnan(ys)  # the steps that have it: a line through them, not points between gaps
            if kept.any():
                ax.plot(xs[kept], ys[kept], color=f"C{index}", linestyle="--", marker="s", markersize=4)
                drawn.add(other)
    y_label = ", ".join([key, *(f"{d} (dashed)" for d in dashed if d in drawn)])
    ax.set(title=panel.title, xlabel=panel.x_label, ylabel=y_label)
    ax.grid(alpha=0.3)


def draw_staleness(figure: Figure, ax, rows: list[dict], label: str, colour: str) -> None:
    shares = staleness_shares(rows)
    first = rows[0]["step"]
    last = rows[-1]["step"]
    image = ax.imshow(shares, origin="lower", aspect="auto", interpolation="nearest", cmap="viridis",
                      vmin=0, vmax=1, extent=(first - 0.5, last + 0.5, -0.5, shares.shape[0] - 0.5))
    figure.colorbar(image, ax=ax, label="share of the batch")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_title(textwrap.fill(f"staleness: {label}", TITLE_CHARS), color=colour)
    limit = max(int(row.get("staleness/limit", 0)) for row in rows)
    ax.set(xlabel="step", ylabel=f"lag in versions (limit {limit})")


def draw_time_split(ax, rows: list[dict], label: str, colour: str) -> None:
    steps, bottom = column(rows, "step"), np.zeros(len(rows))
    for (key, name), bar_colour in zip(TIME_SPLIT.items(), TIME_COLOURS):
        seconds = np.nan_to_num(column(rows, key))  # a run logged before the split existed: empty bars
        ax.bar(steps, seconds, bottom=bottom, width=1.0, linewidth=0, color=bar_colour, label=name)
        bottom += seconds
    ax.set_xlim(steps[0] - 0.5, steps[-1] + 0.5)  # the same steps as the heatmap beside it
    ax.set_title(textwrap.fill(f"step time: {label}", TITLE_CHARS), color=colour)
    ax.set(xlabel="step", ylabel="seconds")
    ax.margins(y=0.2)  # headroom for the legend


def save_plot(run_dirs: list[str], output: Optional[str] = None) -> Path:
    """Read the runs, draw them, write the PNG (default `<first RUN_DIR>/plot.png`); returns its path."""
    runs = [read_run(run_dir) for run_dir in run_dirs]
    path = Path(output) if output else claim(runs[0].path, "plot.png")  # in a run's folder: listed
    path.parent.mkdir(parents=True, exist_ok=True)
    draw(runs).savefig(path, dpi=100)
    return path
