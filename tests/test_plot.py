"""`nanoverl-async plot`: the per-panel arrays and run labels (fast, pure), bad run directories (one line,
status 2), and the figure drawn from a short real run beside an edited copy of it (slow).
Run alone: `python -m pytest tests/test_plot.py -q`.
"""

import json
import shutil

import numpy as np
import pytest
import yaml

from nanoverl_async.cli import main
from nanoverl_async.config import ConfigError
from nanoverl_async.observe.plot import column, draw, read_rows, read_run, run_labels, staleness_shares
from test_cli_run import read_metrics


def row(step, **extra):
    return {"step": step, "reward/mean": 0.1 * step, "time/step_s": 2.0, "time/wait_batch_s": 0.5,
            "time/train_s": 1.0, "time/publish_s": 0.5, "generators/gated_frac": 0.25,
            "tokens/generated_per_s": 100.0 * step, "staleness/limit": 2, "staleness/histogram": {"0": 4}, **extra}


def write_run(path, rows, config=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "config.yaml").write_text(yaml.safe_dump(config or {"staleness": {"max": 2}}))
    return path


def test_a_column_gives_one_value_per_step_and_nan_where_a_row_lacks_the_key():
    rows = [row(0), row(1), {"step": 2, "reward/mean": 0.5, "time/step_s": 1.0}]  # an older row: no split
    assert column(rows, "step").tolist() == [0, 1, 2] and column(rows, "reward/mean").tolist() == [0.0, 0.1, 0.5]
    assert column(rows, "time/train_s")[:2].tolist() == [1.0, 1.0] and np.isnan(column(rows, "time/train_s")[2])
    assert np.isnan(column(rows, "generators/gated_frac")[2]) and np.isnan(column(rows, "episodes/tool_use_frac")).all()


def test_staleness_shares_are_per_step_fractions_up_to_the_limit_or_the_largest_lag():
    rows = [row(0, **{"staleness/histogram": {"0": 3, "1": 1}}), row(1, **{"staleness/histogram": {"2": 8}}),
            row(2, **{"staleness/histogram": {}})]
    assert staleness_shares(rows).tolist() == [[0.75, 0, 0], [0.25, 0, 0], [0, 1, 0]]  # lags 0..limit 2
    beyond = [row(0, **{"staleness/limit": 1, "staleness/histogram": {"3": 2}})]
    assert staleness_shares(beyond).shape == (4, 1)


def test_runs_are_labelled_by_their_config_differences():
    base = {"run": {"output_dir": "a", "seed": 0}, "staleness": {"max": 2}, "algorithm": {"correction": "decoupled"}}
    other = {"run": {"output_dir": "b", "seed": 0}, "staleness": {"max": 4}, "algorithm": {"correction": "none"}}
    assert run_labels([base, other], ["a", "b"]) == ["algorithm.correction=decoupled, staleness.max=2",
                                                     "algorithm.correction=none, staleness.max=4"]
    assert run_labels([base], ["my_run"]) == ["my_run"]
    assert run_labels([base, {**base, "run": {"output_dir": "b", "seed": 0}}], ["a", "b"]) == ["a", "b"]
    many = [{f"k{i}": 0 for i in range(6)}, {f"k{i}": 1 for i in range(6)}]
    assert run_labels(many, ["a", "b"]) == ["k0=0, k1=0, k2=0, k3=0, +2 more", "k0=1, k1=1, k2=1, k3=1, +2 more"]
    assert run_labels([{"x": 1}, {"x": 1, "y": False}], ["a", "b"]) == ["y=unset", "y=false"]  # override spelling


def test_the_row_a_live_run_is_writing_is_left_out(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(row(1)) + "\n\n" + json.dumps(row(2))[:20])
    assert [r["step"] for r in read_rows(path)] == [1]


def test_an_older_runs_rows_are_read_as_written_now(tmp_path):
    """Rows written before 2026-11-29: the engines' counters under `generator/` (now `generators/`), and steps
    counted from 0 (learner/version one ahead; rows cut to a few keys tell by their first step, 0)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(row(1, **{"generator/preemptions": 3, "generator/prefix_cache_hit_frac": 0.5})) + "\n")
    (read,) = read_rows(path)
    assert (read["generators/preemptions"], read["generators/prefix_cache_hit_frac"]) == (3, 0.5)
    assert not any(key.startswith("generator/") for key in read) and read["step"] == 1
    for older, now in (([row(0), row(1)], [1, 2]), ([row(4, **{"learner/version": 5})], [5]),
                       ([row(4, **{"learner/version": 4})], [4]), ([row(3)], [3])):
        path.write_text("".join(json.dumps(r) + "\n" for r in older))
        assert [r["step"] for r in read_rows(path)] == now


def test_the_held_out_score_is_dashed_on_the_reward_panels_where_it_was_taken(tmp_path):
    evaluated = {2: 0.5, 4: 0.75}  # run.eval_every=2
    run = write_run(tmp_path / "run", [row(step, **({"eval/reward_mean": evaluated[step]} if step in evaluated else {}))
                                       for step in (1, 2, 3, 4)])
    plain = write_run(tmp_path / "plain", [row(step) for step in (1, 2)])
    axes = {ax.get_title(): ax for ax in draw([read_run(run), read_run(plain)]).axes if ax.get_title()}
    for title, xs in (("reward vs step", [2, 4]), ("reward vs wall clock", [4.0, 8.0])):  # time/step_s is 2 s
        trained, held_out, other = axes[title].get_lines()  # the plain run has no dashed line
        assert (held_out.get_linestyle(), held_out.get_color()) == ("--", trained.get_color())
        assert held_out.get_xdata().tolist() == xs and held_out.get_ydata().tolist() == [0.5, 0.75]
        assert axes[title].get_ylabel() == "reward/mean, eval/reward_mean (dashed)"
    assert axes["generators gated"].get_ylabel() == "generators/gated_frac"


@pytest.mark.parametrize("breakage,named", [
    (lambda run: (run / "metrics.jsonl").unlink(), "metrics.jsonl: no such file"),
    (lambda run: (run / "metrics.jsonl").write_text(""), "metrics.jsonl: no steps logged"),
    (lambda run: (run / "metrics.jsonl").write_text('{"step": 1}\n[1, 2]\n'), "metrics.jsonl:2: not a metrics row"),
    (lambda run: (run / "config.yaml").unlink(), "config.yaml: no such file"),
    (lambda run: (run / "config.yaml").write_text("a: [1,\n"), "config.yaml' is not valid YAML"),
], ids=["no-metrics", "empty-metrics", "bad-row", "no-config", "bad-config"])
def test_a_bad_run_directory_is_one_line_naming_the_file(tmp_path, capsys, breakage, named):
    run = write_run(tmp_path / "run", [row(0)])
    breakage(run)
    with pytest.raises(ConfigError, match=named):
        read_run(run)
    assert main(["plot", str(run)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and str(run) in error and named in error and "Traceback" not in error
    assert not (run / "plot.png").exists()


@pytest.fixture(scope="module")
def two_runs(observed_run, tmp_path_factory):
    """A real 4-step run (conftest.py, staleness.max=1), and a copy of it whose config says
    staleness.max=4, correction=none."""
    root = tmp_path_factory.mktemp("plot")
    first, second = root / "first", root / "second"
    shutil.copytree(observed_run, first, ignore=shutil.ignore_patterns("final", "record"))
    shutil.copytree(first, second)
    config = yaml.safe_load((second / "config.yaml").read_text())
    config["run"]["output_dir"] = str(second)  # always differs between runs: never part of a label
    config["staleness"]["max"], config["algorithm"]["correction"] = 4, "none"
    (second / "config.yaml").write_text(yaml.safe_dump(config))
    return first, second


@pytest.mark.slow
def test_the_figure_of_two_real_runs_has_every_panel(two_runs):
    first, second = two_runs
    rows = read_metrics(first)
    labels = ["algorithm.correction=decoupled, staleness.max=1", "algorithm.correction=none, staleness.max=4"]
    figure = draw([read_run(first), read_run(second)])
    axes = {ax.get_title(): ax for ax in figure.axes if ax.get_title()}
    assert set(axes) == {"reward vs step", "reward vs wall clock", "generators gated", "generated tokens/s",
                         "tool use: share of episodes with a tool call", "tool errors: failed calls / calls",
                         *(f"{panel}: {label}" for label in labels for panel in ("staleness", "step time"))}
    reward = axes["reward vs step"]
    assert [text.get_text() for text in figure.legends[0].get_texts()] == labels  # one legend for the figure
    tool_use = axes["tool use: share of episodes with a tool call"].get_lines()[0].get_ydata()
    assert tool_use.tolist() == [r["episodes/tool_use_frac"] for r in rows]
    for line in reward.get_lines():  # one point per step, for each run
        assert line.get_xdata().tolist() == [1, 2, 3, 4]
        assert line.get_ydata().tolist() == [r["reward/mean"] for r in rows]
    wall = axes["reward vs wall clock"].get_lines()[0].get_xdata()
    assert np.allclose(wall, np.cumsum([r["time/step_s"] for r in rows]))
    lags = max([int(lag) for r in rows for lag in r["staleness/histogram"]] + [rows[0]["staleness/limit"]])
    heatmap = axes[f"staleness: {labels[0]}"].images[0].get_array()
    assert heatmap.shape == (lags + 1, 4) and np.allclose(heatmap.sum(axis=0), 1.0)
    bars = axes[f"step time: {labels[1]}"].patches  # wait, train and publish for each step
    assert len(bars) == 3 * 4
    tops = [max(bar.get_y() + bar.get_height() for bar in bars if bar.get_x() < step < bar.get_x() + 1)
            for step in (1, 2, 3, 4)]
    assert np.allclose(tops, [r["time/step_s"] for r in rows])


@pytest.mark.slow
def test_the_cli_writes_the_png_into_the_first_run(two_runs, capsys):
    first, second = two_runs
    assert main(["plot", str(first), str(second)]) == 0
    assert capsys.readouterr().out.strip() == str(first / "plot.png")
    assert (first / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
