"""Every ready-made config in configs/ runs on the embedded default: 2 steps of 4 groups, in this process
(one Ray instance for all, as bench/ does), checking each algorithm's own metrics.

Run alone: `python -m pytest tests/test_configs_run.py -q` (~2 min on 2 cores).
"""

import json
import math

import pytest

from nanoverl_async.config import load_config
from nanoverl_async.launcher import launch

pytestmark = pytest.mark.slow

SMALL = ["run.total_steps=2", "data.prompts_per_step=4", "data.samples_per_prompt=4", "run.progress=false"]


@pytest.mark.parametrize("name, expected_steps_per_batch", [
    ("drgrpo", 1), ("dapo", 1), ("gspo", 2), ("cispo", 2), ("ppo_critic", 1),  # agent_grpo: test_cli_run.py
])
def test_config_runs_a_few_steps(ray_session, tmp_path, name, expected_steps_per_batch):
    cfg = load_config(f"configs/{name}.yaml", SMALL + [f"run.output_dir={tmp_path}"])
    launch(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["learner/optimizer_steps"] == expected_steps_per_batch
        assert row["learner/version"] == row["step"]  # one version per batch, whatever the steps
        assert math.isfinite(row["learner/loss"]) and math.isfinite(row["learner/mismatch_kl"])
        assert row["staleness/max"] <= row["staleness/limit"]
    if cfg.algorithm.group_filter:
        assert "buffer/dropped_filtered" in rows[-1]
        # every group handed out carries signal: its G rewards do not all tie
        assert all(0.0 < row["reward/mean"] < 1.0 for row in rows)
    if cfg.algorithm.advantage == "gae":
        assert all(math.isfinite(row["learner/value_loss"] + row["learner/explained_variance"]) for row in rows)
    assert (tmp_path / "final" / "config.json").is_file()
