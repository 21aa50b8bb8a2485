"""The real CLI for a few steps: the tier that catches wiring mistakes. conftest.py's observed run and the bad
config go through `python -m nanoverl_async.cli` in a subprocess; the other launches call the same `main` in
this process, on the session's Ray instance (no new Python and Ray per launch: ~15 s each on 2 cores)."""

import json
import shutil
import subprocess
import sys
import time

import pytest

from nanoverl_async.cli import main

pytestmark = pytest.mark.slow

REQUIRED_KEYS = {"step", "reward/mean", "staleness/max", "staleness/mean", "staleness/limit", "samples/trained",
                 "time/step_s", "tokens/generated_per_s", "weights/version_lag_max", "episodes/turns_mean",
                 "episodes/tool_calls_mean", "generators/gated_frac", "time/wait_batch_s", "time/train_s",
                 "time/publish_s"}


def run_cli(tmp_path, *overrides, timeout=600, config="configs/agent_grpo.yaml"):
    command = [sys.executable, "-m", "nanoverl_async.cli", "launch", config,
               f"run.output_dir={tmp_path}", "run.progress=false", *overrides]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def launch_in_process(tmp_path, *overrides, config="configs/agent_grpo.yaml") -> int:
    """`nanoverl-async launch` as run_cli gives it, through the CLI's `main`; needs the ray_session fixture."""
    return main(["launch", config, f"run.output_dir={tmp_path}", "run.progress=false", *overrides])


def read_metrics(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


# First in the suite's order: conftest.py's run then starts before the session's Ray instance, which would slow
# it (~25% beside an idle one) and the simulator's self-prediction in test_simulate.py reads its timings.
def test_a_run_with_every_observation_key_on(observed_run):
    """conftest.py's run (4 steps, staleness.max=1, two generators, run.log_samples=3 and more)."""
    steps = 4
    check_run(observed_run, steps)
    samples = [json.loads(line) for line in (observed_run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [step for step in range(1, steps + 1) for _ in range(3)]
    assert all(s["messages"][0]["role"] == "user" and s["versions"] for s in samples)
    assert any(m["role"] == "tool" for s in samples for m in s["messages"])  # the warm start calls tools
    phases = ["] starting Ray", "] model builtin:tiny", "] learner memory: an update's peak predicted at",
              "] placing the buffer, 2 generator(s) and 1 learner rank(s)", "] roles ready", "] first batch ready; training step 1"]
    console = (observed_run / "console.txt").read_text()
    assert all(line in console for line in phases), console[-2000:]
    assert sorted(phases, key=console.index) == phases  # in order, one line each, with seconds since launch
    rows = read_metrics(observed_run)
    elapsed = [float(console.split(line)[0].rsplit("[", 1)[1].split(" s")[0]) for line in phases]
    assert elapsed == sorted(elapsed) and elapsed[-1] < rows[0]["time/startup_s"]
    assert all("time/startup_s" not in row for row in rows[1:])  # the first trained step's only
    assert "resuming from" not in console  # a fresh run
    seconds = sum(row["time/step_s"] for row in rows)  # the summary: from these rows, reward first -> last step
    out = observed_run.resolve()
    # the prediction logged at start (learners/memory.py), beside the largest peak of any step
    predicted = float(console.split("] learner memory: an update's peak predicted at ")[1].split(" GB")[0])
    peak = max(row["memory/learner_peak_host_gb"] for row in rows)
    assert "\n".join([
        f"done: 4 steps in {seconds:.0f} s, {16 * steps / seconds:.1f} samples/s; reward {rows[0]['reward/mean']:.3f} "
        f"-> {rows[-1]['reward/mean']:.3f} (mean of the first and the last 1 step(s))",
        f"  learner memory: predicted {predicted:.1f} GB, measured peak {peak:.1f} GB (memory/learner_peak_host_gb, "
        f"max over steps)", f"  final model: {out}/final",
        f"  samples:     {out}/samples.jsonl (3 episodes a step)",
        f"  metrics:     {out}/metrics.jsonl; plot them: nanoverl-async plot {out}"]) + "\n" in console, console[-2000:]


def test_cli_runs_two_ranks_two_generators_synchronously_with_drain(ray_session, tmp_path):
    assert launch_in_process(tmp_path, "run.total_steps=3", "staleness.max=0", "learner.world_size=2",
                             "generator.replicas=2", "weight_sync.mode=drain", "data.prompts_per_step=4") == 0
    check_run(tmp_path, 3)


def check_run(path, steps: int) -> None:
    rows = read_metrics(path)
    assert [row["step"] for row in rows] == [row["learner/version"] for row in rows] == list(range(1, steps + 1))
    for row in rows:
        assert REQUIRED_KEYS <= set(row)
        assert row["staleness/max"] <= row["staleness/limit"]
        assert 0.0 <= row["reward/mean"] <= 1.0
    assert rows[-1]["samples/trained"] == steps * rows[0]["samples/trained"]
    assert (path / "final" / "config.json").is_file()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(path / "final")  # loadable by the standard path


def test_cli_bad_config_fails_before_starting(tmp_path):
    result = run_cli(tmp_path, "staleness.max=-1", timeout=60)
    assert result.returncode == 2
    assert "staleness.max" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


NONE_REWARD_ENV = '''
from nanoverl_async import Step
from nanoverl_async.agents.multiply_task import MultiplyEnv


class NoneReward(MultiplyEnv):
    async def step(self, sample, message):
        if sample["index"] >= 4:  # from the third group on: synchronously with 2 groups a step, after step 1
            return Step(reward=None)
        return await super().step(sample, message)
'''


def test_a_non_number_reward_fails_the_run_in_one_line_and_keeps_what_was_logged(ray_session, tmp_path, capsys):
    (tmp_path / "none_env.py").write_text(NONE_REWARD_ENV)
    out = tmp_path / "out"
    assert launch_in_process(out, "run.total_steps=6", "staleness.max=0", "data.prompts_per_step=2",
                             "data.samples_per_prompt=4", "run.log_samples=2",
                             f"agent.env={tmp_path}/none_env.py:NoneReward") == 1
    err = capsys.readouterr().err
    assert ("nanoverl-async: run failed: generator 0: UserCodeError: agent.env NoneReward.step() raised ValueError: "
            "Step(reward=None): the reward must be a finite number, not NoneType at none_env.py:9 in step\n") in err
    assert "Traceback" not in err
    steps = [row["step"] for row in read_metrics(out)]
    assert steps[:2] == [1, 2] and steps == list(range(1, len(steps) + 1))  # index 4: leased at version 2 at earliest
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [step for step in steps for _ in range(2)]


HUNG_STEP_ENV = '''
import threading

from nanoverl_async.agents.multiply_task import MultiplyEnv


class HungStep(MultiplyEnv):
    def step(self, sample, message):
        threading.Event().wait()  # never returns
'''


def test_a_hung_hook_fails_the_run_in_one_line_at_its_timeout(ray_session, tmp_path, capsys):
    """A step() that never returns fails the launch with the line naming it at agent.hook_timeout_s, not at
    run.step_timeout_s (300 s) with the buffer's line naming no hook, and the run ends though the hook never does."""
    (tmp_path / "hung_env.py").write_text(HUNG_STEP_ENV)
    started = time.monotonic()
    env = f"agent.env={tmp_path}/hung_env.py:HungStep"
    assert launch_in_process(tmp_path / "out", "agent.hook_timeout_s=2", env) == 1
    assert time.monotonic() - started < 150  # the start, the first turns, then 2 s
    err = capsys.readouterr().err
    assert ("nanoverl-async: run failed: generator 0: UserCodeError: agent.env HungStep.step() (defined at "
            "hung_env.py:8) did not return within 2 s (agent.hook_timeout_s); it was at hung_env.py:9 in step\n") in err
    assert "Traceback" not in err


def test_cli_saves_and_resumes_the_whole_async_state(ray_session, tmp_path, capsys):
    """4 steps saving every 2, then the same command resumed to 6 steps: each step logged once, the learner
    continues at version 4, and no prompt is trained on twice across the two runs."""
    common = ("run.save_every=2", "staleness.max=1", "data.prompts_per_step=4", "data.samples_per_prompt=4")
    assert launch_in_process(tmp_path, "run.total_steps=4", *common) == 0
    assert "resuming from" not in capsys.readouterr().err
    shutil.rmtree(tmp_path / "final")  # as if it had crashed after its last checkpoint, before final/
    assert launch_in_process(tmp_path, "run.total_steps=4", "run.resume=auto", *common) == 0
    resumed = [line for line in capsys.readouterr().err.splitlines() if "resuming from" in line]
    assert len(resumed) == 1 and resumed[0].endswith(
        f"] resuming from step_4 ({tmp_path.resolve()}/checkpoints/step_4): no step left, final/ to write")
    assert (tmp_path / "final" / "config.json").is_file()
    capsys.readouterr()  # only the next launch's stderr below
    again = launch_in_process(tmp_path, "run.total_steps=6", *common)  # a fresh launch must not reuse the directory
    stderr = capsys.readouterr().err
    assert again == 2 and "run.resume=auto" in stderr and "Traceback" not in stderr
    assert launch_in_process(tmp_path, "run.total_steps=6", "run.resume=auto", *common) == 0
    err = capsys.readouterr().err
    assert "changed config keys" not in err and "resuming from step_4" in err  # only run.*, which resuming allows
    assert "] resuming from step_4" in err and f"checkpoints/step_4): steps 5-6\n" in err
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == list(range(1, 7))
    assert rows[4]["learner/version"] == 5  # step 5: the restored weights were version 4, trained once more
    assert "done: steps 5-6 in this launch (2 steps, " in err and "all 6 steps of metrics.jsonl in " in err
    for row in rows:
        assert row["staleness/max"] <= 1  # step N trained on versions >= N - 1 - staleness.max
        assert row["buffer/consumed"] == 4 * row["step"]  # the gate's counters were restored too
        assert row["samples/trained"] == 16 * row["step"]
    trained = [index for row in rows for index in row["batch/prompt_indices"]]
    assert len(trained) == 6 * 4 and len(set(trained)) == len(trained)  # no prompt trained on twice
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert checkpoints == ["step_4", "step_6"]  # run.keep_checkpoints=2 pruned step_2
    meta = json.loads((tmp_path / "checkpoints" / "step_4" / "meta.json").read_text())
    assert meta["step"] == 4 and meta["buffer"]["consumed"] == 16
