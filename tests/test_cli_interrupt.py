"""An interrupted launch (Ctrl-C) says in one line how to go on: the same command with run.resume=auto when
the run saved a checkpoint, else that it saved none."""

import pytest

from nanoverl_async.cli import launch_run, resume_hint
from nanoverl_async.config import load_config

COMMAND = ["launch", "configs/agent_grpo.yaml", "run.resume=", "run.output_dir=my runs/a", "run.save_every=2"]
NONE_SAVED = "no checkpoint was saved, so it cannot be resumed (run.save_every=N saves one every N steps)"


def saved_run(tmp_path, save_every: int):
    """A config whose output_dir holds complete step_3 and step_5, and step_7 and .step_9.tmp incomplete."""
    saves = tmp_path / "checkpoints"
    for step in (3, 5):
        (saves / f"step_{step}").mkdir(parents=True)
        (saves / f"step_{step}" / "meta.json").write_text("{}")
    (saves / "step_7").mkdir()  # no meta.json: a folder never published
    (saves / ".step_9.tmp").mkdir()
    (saves / ".step_9.tmp" / "meta.json").write_text("{}")
    return load_config("configs/agent_grpo.yaml", [f"run.output_dir={tmp_path}", f"run.save_every={save_every}"])


def test_a_run_with_a_checkpoint_is_told_the_same_command_with_resume_auto(tmp_path):
    assert resume_hint(saved_run(tmp_path, 2), COMMAND) == (
        "to resume from checkpoint step_5: nanoverl-async launch configs/agent_grpo.yaml 'run.output_dir=my runs/a' "
        "run.save_every=2 run.resume=auto")


@pytest.mark.parametrize("save_every", [0, 1])
def test_a_run_without_a_checkpoint_is_told_none_was_saved(tmp_path, save_every):
    """save_every=0: checkpoints of an earlier run are not this run's; save_every=1: none complete yet."""
    cfg = saved_run(tmp_path, save_every)
    if save_every:
        for step in (3, 5):
            (tmp_path / "checkpoints" / f"step_{step}" / "meta.json").unlink()
    assert resume_hint(cfg, COMMAND) == NONE_SAVED


class InterruptedLauncher:
    RunFailed = RuntimeError

    def launch(self, cfg, started):
        raise KeyboardInterrupt


@pytest.mark.parametrize("save_every", [0, 2])
def test_launch_run_prints_the_hint_on_ctrl_c_and_exits_130(tmp_path, capsys, save_every):
    cfg = saved_run(tmp_path, save_every)
    assert launch_run(InterruptedLauncher(), cfg, 0.0, COMMAND) == 130
    hint = NONE_SAVED if save_every == 0 else (
        "to resume from checkpoint step_5: nanoverl-async launch configs/agent_grpo.yaml 'run.output_dir=my runs/a' "
        "run.save_every=2 run.resume=auto")
    assert capsys.readouterr() == ("", f"nanoverl-async: interrupted; {hint}\n")
