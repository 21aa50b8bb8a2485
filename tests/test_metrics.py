"""step_metrics is pure: the keys the issue promises, from a hand-made batch whose stats are the buffer's."""

import json

import numpy as np

from nanoverl_async.buffer.replay import Group
from nanoverl_async.buffer.service import Batch, batch_stats
from nanoverl_async.observe.metrics import (BUFFER_STAT_KEYS, MetricsLogger, reward_info_means, run_summary,
                                           step_metrics)
from nanoverl_async.wire.trajectory import Trajectory


def trajectory(version: int, reward: float, tool_calls: int) -> Trajectory:
    mask = np.array([0, 0, 1, 1, 0, 1], dtype=np.uint8)
    return Trajectory(id=f"{version}-{reward}", group_id=0, prompt_index=0, sample_index=0,
                      token_ids=np.arange(6, dtype=np.int32), loss_mask=mask,
                      behaviour_logprobs=np.where(mask == 1, -0.5, 0.0).astype(np.float32),
                      versions=np.where(mask == 1, version, -1).astype(np.int32), reward=reward,
                      num_turns=1 + tool_calls, tool_calls=tool_calls)


# the service's counters of a batch when nothing was dropped and the generators' clocks reported nothing
QUIET_COUNTERS = {"dropped_stale": 0, "generators_gated_frac": 0.0, "generators_busy_frac": 0.0,
                  "generators_tool_wait_frac": 0.0, "tokens_per_s": 0.0}


def make_batch(version: int, trajectories: list[Trajectory], **counters) -> Batch:
    """What BufferService.next_batch builds for the update of weights `version` (step version + 1): batch_stats
    over the groups plus the service counters."""
    groups = [Group(group_id=i, prompt_index=i, lease_version=0, samples={0: t}) for i, t in enumerate(trajectories)]
    return Batch(trajectories, {**batch_stats(version, groups), **counters})


def test_step_metrics_keys_and_values(tmp_path):
    batch = make_batch(5, [trajectory(5, 1.0, 1), trajectory(3, 0.0, 0), trajectory(4, 1.0, 1), trajectory(4, 0.0, 0)],
                       generator_versions={0: 4, 1: 5}, tokens_generated=120, tokens_per_s=60.0, dropped_stale=2,
                       wait_s=0.25, generators_gated_frac=0.125, generators_busy_frac=0.625,
                       generators_tool_wait_frac=0.25)
    m = step_metrics(6, 2, batch, {"loss": 0.1, "grad_norm": 0.5}, step_seconds=2.0, samples_trained=24)
    assert m["step"] == 6 and m["reward/mean"] == 0.5 and m["reward/std"] == 0.5
    assert m["staleness/max"] == 2 and m["staleness/mean"] == 1.0 and m["staleness/limit"] == 2
    assert m["staleness/histogram"] == {"0": 1, "1": 2, "2": 1} and m["staleness/dropped"] == 2
    assert m["staleness/token_histogram"] == {"0": 3, "1": 6, "2": 3} and m["staleness/token_mean"] == 1.0
    assert m["samples/trained"] == 24 and m["time/step_s"] == 2.0
    assert m["tokens/generated_per_s"] == 60.0 and m["weights/version_lag_max"] == 1
    assert m["episodes/turns_mean"] == 1.5 and m["episodes/tool_calls_mean"] == 0.5
    assert m["episodes/tool_errors_mean"] == 0.0 and m["episodes/generated_tokens_mean"] == 3.0
    assert m["learner/loss"] == 0.1 and m["learner/grad_norm"] == 0.5 and m["generators/gated_frac"] == 0.125
    assert m["generators/busy_frac"] == 0.625 and m["generators/tool_wait_frac"] == 0.25
    # each statistic appears once: the buffer's batch stats are not copied into buffer/*, its counters are
    assert not {f"buffer/{key}" for key in BUFFER_STAT_KEYS} & set(m) and "buffer/step" not in m
    assert m["buffer/wait_s"] == 0.25 and m["buffer/tokens_generated"] == 120
    assert m["buffer/batch_tokens_generated"] == 12

    logger = MetricsLogger(tmp_path, total_steps=6, progress=False)
    logger.log(m)
    logger.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["staleness/max"] == 2
    # one prefix per role: the engines' counters are the generators' too, not a `generator/` beside `generators/`
    prefixes = {key.split("/")[0] for key in m if "/" in key}
    assert {"generators", "learner", "buffer"} <= prefixes and not {p for p in prefixes if f"{p}s" in prefixes}
    assert m["generators/preemptions"] == 0 and m["generators/prefix_cache_hit_frac"] == 0.0


def test_staleness_ignores_episodes_that_sampled_no_token():
    """Version -1 (no sampled token) is not a lag of step + 1: staleness stays within the limit."""
    silent = trajectory(0, 0.0, 0)
    silent.loss_mask[:] = 0
    silent.versions[:] = -1
    batch = make_batch(3, [trajectory(3, 1.0, 0), silent], **QUIET_COUNTERS)
    m = step_metrics(4, 1, batch, {}, step_seconds=1.0, samples_trained=2)
    assert m["staleness/max"] == 0 and m["staleness/histogram"] == {"0": 1} and m["reward/mean"] == 0.5


def test_a_run_stuck_on_tied_rewards_warns_once(tmp_path, capsys):
    """Groups whose rewards all tie carry no group-relative advantage: after 3 such steps in a row the
    logger says so once, with the likely cause; one informative group resets the count."""
    def metrics(step: int, rewards: list[float]) -> dict:
        trajectories = [trajectory(step - 1, reward, 0) for reward in rewards]
        for index, t in enumerate(trajectories):
            t.group_id = index // 2  # groups of two
        batch = make_batch(step - 1, trajectories, **QUIET_COUNTERS)
        return step_metrics(step, 1, batch, {}, step_seconds=1.0, samples_trained=4)

    assert metrics(1, [0.0, 0.0, 1.0, 1.0])["batch/tied_groups_frac"] == 1.0
    assert metrics(1, [0.0, 1.0, 1.0, 1.0])["batch/tied_groups_frac"] == 0.5
    logger = MetricsLogger(tmp_path, total_steps=10, progress=False)
    for step, rewards in enumerate([[0.0] * 4, [0.0] * 4, [0.0, 1.0, 0.0, 0.0], [0.0] * 4, [0.0] * 4], start=1):
        logger.log(metrics(step, rewards))
    assert capsys.readouterr().err == ""  # never three tied steps in a row yet
    for step in (6, 7, 8, 9):
        logger.log(metrics(step, [0.0] * 4))
    logger.close()
    warning = capsys.readouterr().err
    assert warning.count("warning:") == 1 and warning.startswith("warning: steps 4-6: within every group")
    assert "reward function never (or always) gives credit" in warning


def test_samples_jsonl_holds_episodes_with_tool_calls_and_reward_parts(tmp_path, capsys):
    """run.log_samples=N: N episodes per step, spread over the batch, with their messages (a tool call's
    arguments and result), reward, the numbers a compute_score dict added (also logged as reward/<key>
    means) and versions; print_sample_every=K prints one every K steps; a resume keeps each step once."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*3"}}}
    messages = [{"role": "user", "content": "12*3?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "36"}, {"role": "assistant", "content": "36"}]
    trajectories = [trajectory(2, float(i % 2), 1) for i in range(8)]
    for i, t in enumerate(trajectories):
        t.sample_index = i
        t.info = {"messages": messages, "final_answer": "36", "reward_info": {"format": 1.0, "acc": i % 2}}
    assert reward_info_means(trajectories) == {"reward/acc": 0.5, "reward/format": 1.0}
    batch = make_batch(3, trajectories, **QUIET_COUNTERS)
    metrics = step_metrics(4, 1, batch, {}, step_seconds=1.0, samples_trained=8)
    assert metrics["reward/acc"] == 0.5 and metrics["reward/format"] == 1.0

    logger = MetricsLogger(tmp_path, total_steps=10, progress=False, log_samples=2, print_sample_every=4)
    for step in (3, 4):
        logger.log({**metrics, "step": step}, trajectories)
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["sample_index"]) for r in rows] == [(3, 0), (3, 4), (4, 0), (4, 4)]  # spread out
    assert rows[0]["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"expression": "12*3"}
    assert rows[0]["messages"][2] == {"role": "tool", "content": "36"} and rows[0]["versions"] == [2]
    assert rows[0]["reward_info"] == {"format": 1.0, "acc": 0} and rows[0]["final_answer"] == "36"
    printed = capsys.readouterr().out
    assert printed.count("sample (step 4, reward 0") == 1 and 'calculator({"expression": "12*3"})' in printed

    resumed = MetricsLogger(tmp_path, total_steps=10, progress=False, start_step=3, log_samples=2)
    resumed.log({**metrics, "step": 4}, trajectories)
    resumed.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert steps == [3, 3, 4, 4]


def summary_row(step: int, reward: float) -> dict:
    """A metrics.jsonl row with what the summary reads (and the logger's warnings check): 8 samples a 0.5 s step."""
    return {"step": step, "reward/mean": reward, "reward/std": 0.5, "time/step_s": 0.5,
            "samples/trained": 8 * step, "batch/tied_groups_frac": 0.0, "episodes/tool_calls": 0,
            "episodes/tool_errors": 0, "episodes/ground_truth_missing": 0}


def test_the_run_summary_averages_the_first_and_last_steps_rewards(tmp_path):
    """Steps, reward/mean over a third of the run at each end (at least 1 step, at most 5), samples trained per
    second of step time, and where the model, samples and metrics are; the window's boundaries exactly."""
    rows = [summary_row(step, (step - 1) / 10) for step in range(1, 19)]
    assert run_summary(rows[:2], tmp_path, tmp_path / "final", log_samples=0).splitlines() == [
        "done: 2 steps in 1 s, 16.0 samples/s; reward 0.000 -> 0.100 (mean of the first and the last 1 step(s))",
        f"  final model: {tmp_path}/final",
        "  samples:     not kept (run.log_samples=N keeps N episodes a step)",
        f"  metrics:     {tmp_path}/metrics.jsonl; plot them: nanoverl-async plot {tmp_path}"]
    for n, window, first, last in ((5, 1, 0.0, 0.4), (6, 2, 0.05, 0.45), (15, 5, 0.2, 1.2), (18, 5, 0.2, 1.5)):
        lines = run_summary(rows[:n], tmp_path, tmp_path / "final", log_samples=3).splitlines()
        assert lines[0] == (f"done: {n} steps in {n / 2:.0f} s, 16.0 samples/s; reward {first:.3f} -> {last:.3f} "
                            f"(mean of the first and the last {window} step(s))")
        assert lines[2] == f"  samples:     {tmp_path}/samples.jsonl (3 episodes a step)"


def test_the_summary_gives_the_held_out_score_first_last_and_best(tmp_path):
    rows = [summary_row(step, 0.5) for step in range(1, 7)]
    for step, score in ((2, 0.3), (4, 0.75), (6, 0.625)):  # run.eval_every=2
        rows[step - 1]["eval/reward_mean"] = score
    lines = run_summary(rows, tmp_path, tmp_path / "final", log_samples=0).splitlines()
    assert lines[1] == ("  eval:        eval/reward_mean 0.300 (step 2) -> 0.625 (step 6), best 0.750 (step 4); "
                        "3 evaluations on data.val_files")
    assert not any("eval" in line for line in run_summary(rows[:1], tmp_path, tmp_path, 0).splitlines())


def test_the_logger_summarises_a_resumed_runs_earlier_steps_too(tmp_path):
    """MetricsLogger.summary reads metrics.jsonl: a run resumed from step_2 counts the earlier run's steps 1-2,
    not the row of step 3 that the earlier run logged after its checkpoint, and tells this launch's steps apart."""
    logger = MetricsLogger(tmp_path, total_steps=4, progress=False)
    for step, reward in ((1, 0.0), (2, 0.0), (3, 0.9)):
        logger.log(summary_row(step, reward))
    logger.close()
    resumed = MetricsLogger(tmp_path, total_steps=4, progress=False, start_step=2)
    for step in (3, 4):
        resumed.log(summary_row(step, 1.0))
    summary = resumed.summary(tmp_path / "final")
    resumed.close()
    assert summary.splitlines()[:2] == [
        "done: steps 3-4 in this launch (2 steps, 1 s); all 4 steps of metrics.jsonl in 2 s, 16.0 samples/s; "
        "reward 0.000 -> 1.000 (mean of the first and the last 1 step(s))",
        f"  final model: {tmp_path.resolve()}/final"]
