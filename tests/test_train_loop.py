"""The controller's loop (launcher.train) as a reader of a run sees it, on roles faked in this process (no Ray, no
model): one numbering of steps everywhere a step is read, from 1, the step that publishes version N being step N on
the console, in metrics.jsonl and in the checkpoint it saves; the held-out score on the console where it was taken.
Run alone: `python -m pytest tests/test_train_loop.py -q`.
"""

import contextlib
import json

from nanoverl_async import launcher
from nanoverl_async.config import load_config
from nanoverl_async.observe.metrics import MetricsLogger
from test_metrics import QUIET_COUNTERS, make_batch, trajectory


class FakeRoles:
    """What `train` asks of the roles: a batch for each version (an episode of it and one a version older), a
    learner told the version each update trains, and the versions published and evaluated."""

    def __init__(self, version: int):
        self.version, self.published, self.evaluated = version, [], []
        self.learners = self

    def next_batch(self, version: int):
        assert version == self.version  # the batch updates the learner's weights
        return make_batch(version, [trajectory(version, 1.0, 1), trajectory(max(0, version - 1), 0.0, 0)],
                          **QUIET_COUNTERS)

    def failures(self, name: str):
        return contextlib.nullcontext()

    def prepare(self, trajectories: list) -> list:
        return trajectories

    def update(self, batch: list, version: int) -> dict:
        assert version == self.version  # the controller hands the learner the version its batch updates
        self.version += 1
        return {"version": self.version}

    def publish_weights(self, version: int) -> None:
        self.published.append(version)

    def evaluate(self, version: int) -> dict:
        self.evaluated.append(version)
        return {"eval/reward_mean": version / 10, "eval/version": version}


def run(tmp_path, monkeypatch, start: int, *overrides):
    """`train` from checkpoint step_`start` (0: a fresh run) to run.total_steps=4 -> (roles, metrics rows, versions
    saved as checkpoints, console lines)."""
    saved = []
    monkeypatch.setattr(launcher, "maybe_checkpoint", lambda cfg, roles, version: saved.append(version))
    cfg = load_config("configs/agent_grpo.yaml", ["run.total_steps=4", "data.prompts_per_step=1",  # the batches' B x G
                                                  "data.samples_per_prompt=2", f"run.output_dir={tmp_path}", *overrides])
    roles = FakeRoles(start)
    logger = MetricsLogger(tmp_path, 4, progress=True, start_step=start)  # not a terminal: a plain line a step
    launcher.train(cfg, roles, logger, start)
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return roles, rows, saved


def test_the_step_that_publishes_version_n_is_step_n_everywhere(tmp_path, monkeypatch, capsys):
    roles, rows, saved = run(tmp_path, monkeypatch, 0)
    assert [r["step"] for r in rows] == [r["learner/version"] for r in rows] == roles.published == saved == [1, 2, 3, 4]
    assert [line.split()[:2] for line in capsys.readouterr().out.splitlines()] == [
        ["step", "1/4"], ["step", "2/4"], ["step", "3/4"], ["step", "4/4"]]
    assert [r["samples/trained"] for r in rows] == [2, 4, 6, 8]
    assert [r["staleness/histogram"] for r in rows] == [{"0": 2}] + [{"0": 1, "1": 1}] * 3  # lag: the version updated


def test_a_resumed_loop_goes_on_with_the_step_after_its_checkpoint(tmp_path, monkeypatch, capsys):
    run(tmp_path, monkeypatch, 0)
    capsys.readouterr()
    roles, rows, saved = run(tmp_path, monkeypatch, 2)  # resumed from step_2: steps 3 and 4 again
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and roles.published == saved == [3, 4]
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines()] == ["3/4", "4/4"]
    assert rows[2]["samples/trained"] == 6


def test_the_steps_that_evaluated_show_their_score_on_the_console(tmp_path, monkeypatch, capsys):
    roles, rows, _ = run(tmp_path, monkeypatch, 0, "run.eval_every=2", "data.val_files=[unread.jsonl]")
    assert roles.evaluated == [2, 4] and [r.get("eval/reward_mean") for r in rows] == [None, 0.2, None, 0.4]
    lines = capsys.readouterr().out.splitlines()
    assert ["eval/reward_mean" in line for line in lines] == [False, True, False, True]
    assert "  eval/reward_mean 0.200  " in lines[1] and "  eval/reward_mean 0.400  " in lines[3]
