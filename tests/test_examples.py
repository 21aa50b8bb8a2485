"""The README's extension stories, run through the real CLI for a few steps (slow tier).

1. examples/arithmetic_env.yaml: a custom environment with a tool in one file, as README shows it.
2. A verl-format parquet dataset with a custom async `compute_score` (reward.path / reward.name), and
   the evaluation hook (run.eval_every on data.val_files).
"""

import pytest
from test_cli_run import launch_in_process, read_metrics

pytestmark = pytest.mark.slow
SMALL = ["run.total_steps=2", "data.prompts_per_step=2", "data.samples_per_prompt=4"]


def launch(config, tmp_path, *overrides):
    """The CLI's launch in this process, on the session's Ray instance (test_cli_run.py)."""
    assert launch_in_process(tmp_path / "out", *SMALL, *overrides, config=config) == 0
    return read_metrics(tmp_path / "out")


def test_example_environment_runs(ray_session, tmp_path):
    rows = launch("examples/arithmetic_env.yaml", tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0 <= r["reward/mean"] <= 1 and 0 <= r["episodes/tool_error_rate"] <= 1 for r in rows)


def test_verl_parquet_with_custom_reward_trains(ray_session, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"data_source": "toy/multiply", "prompt": [{"role": "user", "content": f"{a}*{b}?"}],
             "reward_model": {"style": "rule", "ground_truth": str(a * b)}, "extra_info": {"index": i}}
            for i, (a, b) in enumerate([(3, 4), (12, 5), (7, 8), (9, 9), (2, 50), (11, 11)])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    (tmp_path / "reward.py").write_text(
        "async def my_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    assert data_source == 'toy/multiply' and 'index' in extra_info\n"
        "    return {'score': float(solution_str.strip() == ground_truth), 'chars': len(solution_str)}\n")
    metrics = launch("configs/agent_grpo.yaml", tmp_path, f"data.train_files=[{tmp_path / 'train.parquet'}]",
                     f"reward.path={tmp_path / 'reward.py'}", "reward.name=my_score", "agent.max_turns=1",
                     f"data.val_files=[{tmp_path / 'train.parquet'}]", "run.eval_every=2")
    assert [r["step"] for r in metrics] == [1, 2] and all(r["episodes/tool_calls_mean"] == 0 for r in metrics)
    assert "eval/reward_mean" not in metrics[0] and metrics[1]["eval/episodes"] == len(rows)  # every 2 steps
    assert 0 <= metrics[1]["eval/reward_mean"] <= 1
