"""Only the run's own files: what a launch may delete, rewrite or write through in run.output_dir.

A launch marks its folder (checkpoint.MARKER) and lists every top-level entry it creates; overwrite and
resume touch only those. Each case below stops the launch in one line (status 2) before Ray would start,
and leaves every file byte for byte as it was, the targets of symbolic links included. Launches go through
the CLI's own error handling (`cli.launch_run`) with Ray's start replaced by a failure, so that a launch that
got past the check fails here instead of starting a run. Nothing here starts Ray.

Run alone: `python -m pytest tests/test_output_dir.py -q`.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from nanoverl_async import checkpoint, launcher
from nanoverl_async.cli import launch_run, main
from nanoverl_async.config import load_config
from nanoverl_async.observe.metrics import MetricsLogger
from nanoverl_async.controller import startup
from nanoverl_async.controller.preflight import prepare

USER_FILES = {"config.yaml": b"model: my own notes\n", "record/mydata.csv": b"a,b\n1,2\n",
              "wandb/other_project/run.txt": b"another project's run\n", "plot.png": b"\x89PNG mine"}
PREFIX = "nanoverl-async: config error: config key 'run.output_dir': "


class RayWouldStart(Exception):
    """Raised where a launch would start Ray: it got past every check of run.output_dir."""


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    def refuse(*args, **kwargs):
        raise RayWouldStart

    monkeypatch.setattr(launcher, "start_ray", refuse)
    monkeypatch.setattr(startup, "start_ray_while_importing", refuse)  # the CLI's, imported when it launches


def config(out, *overrides):
    return load_config("configs/agent_grpo.yaml", [f"run.output_dir={out}", "run.progress=false", *overrides])


def launch_status(out, *overrides) -> int:
    command = ["launch", "configs/agent_grpo.yaml", f"run.output_dir={out}", "run.progress=false", *overrides]
    return launch_run(launcher, config(out, *overrides), time.time(), command)


def error_lines(err: str) -> str:
    """stderr without the launch's progress lines ("[  0.1 s] model ...")."""
    return "".join(line + "\n" for line in err.splitlines() if not line.startswith("["))


def tree(folder: Path) -> dict:
    """Every file under `folder` (links not followed) -> its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def user_folder(out: Path) -> dict:
    for name, data in USER_FILES.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    return tree(out)


def unmarked_refusal(out) -> str:
    return (f"{PREFIX}'{out}' is not empty and has no .nanoverl-run.json, so it is no run's folder (or a run's from "
            f"a version without run markers); nothing was changed: choose another run.output_dir or move its files "
            f"away (an older run's checkpoint resumes into a new run.output_dir with run.resume=<its step_N "
            f"folder>)\n")


def test_overwrite_deletes_no_user_file_named_like_a_runs(tmp_path, capsys):
    """The user's config.yaml, record/, wandb/ and plot.png: names a run writes, in a folder no run marked."""
    before = user_folder(tmp_path)
    assert launch_status(tmp_path, "run.overwrite=true") == 2
    assert error_lines(capsys.readouterr().err) == unmarked_refusal(tmp_path)
    assert tree(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "config.yaml", "plot.png", "record", "wandb"]


def test_auto_in_a_folder_that_never_held_a_run_deletes_nothing(tmp_path, capsys):
    """run.resume=auto finds no checkpoint there: not "a run that died early" to clear and restart."""
    before = user_folder(tmp_path)
    assert launch_status(tmp_path, "run.resume=auto") == 2
    assert error_lines(capsys.readouterr().err) == unmarked_refusal(tmp_path)  # not "starting a fresh run"
    assert tree(tmp_path) == before


def died_after_step_2(out: Path) -> None:
    """The folder a launch leaves when it dies after its checkpoint of step 2: marked, config.yaml,
    metrics.jsonl's two rows and checkpoints/step_2."""
    with pytest.raises(RayWouldStart):
        launcher.launch(config(out))
    logger = MetricsLogger(out, 4, progress=False)
    logger.file.write('{"step": 1}\n{"step": 2}\n')
    logger.close()
    folder = checkpoint.begin(str(out), 2)
    (folder / "learner").mkdir()
    (folder / "learner" / ".metadata").write_bytes(b"x")
    (folder / "buffer.msgpack").write_bytes(b"x")
    checkpoint.commit(folder, checkpoint.make_meta(prepare(config(out)), 2, {}), 2)


def test_the_same_command_takes_over_a_run_that_died_before_its_first_step(tmp_path, capsys):
    """A first launch that died starting leaves its marker, config.yaml and an empty metrics.jsonl: the same command
    again clears exactly those, says so in one line and starts. Once a step is logged, the folder is refused."""
    out = tmp_path / "out"
    with pytest.raises(RayWouldStart):
        launcher.launch(config(out))
    MetricsLogger(out, 4, progress=False).close()  # opened before the first step, empty
    capsys.readouterr()
    with pytest.raises(RayWouldStart):
        launch_status(out)
    assert error_lines(capsys.readouterr().err) == (f"{out}: the run there finished no step (no metrics row, no "
                                                    f"checkpoint); starting afresh\n")
    assert sorted(p.name for p in out.iterdir()) == [checkpoint.MARKER, "config.yaml"]  # the new launch's alone
    logger = MetricsLogger(out, 4, progress=False)
    logger.file.write('{"step": 1')  # a row, even a torn one: a step was trained
    logger.close()
    before = tree(out)
    assert launch_status(out) == 2
    assert "already holds a run and no checkpoint is resumed" in capsys.readouterr().err and tree(out) == before


def test_the_cli_refuses_a_folder_holding_a_run_before_ray_starts(tmp_path, capsys):
    out = tmp_path / "out"
    died_after_step_2(out)
    before = tree(out)
    capsys.readouterr()
    assert main(["launch", "configs/agent_grpo.yaml", f"run.output_dir={out}", "run.progress=false"]) == 2
    assert capsys.readouterr().err == (f"{PREFIX}'{out}' already holds a run and no checkpoint is resumed; set "
                                       f"run.resume=auto to continue it, a new run.output_dir, or run.overwrite=true "
                                       f"to clear it\n")
    assert tree(out) == before


@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl"])
def test_auto_never_writes_through_a_symlinked_entry(tmp_path, capsys, name):
    """config.yaml's target was replaced and metrics.jsonl's got a row appended, outside the folder."""
    out, outside = tmp_path / "out", tmp_path / f"outside-{name}"
    died_after_step_2(out)
    outside.write_bytes(b"the user's own file\n")
    (out / name).unlink()
    (out / name).symlink_to(outside)
    before = tree(out)
    capsys.readouterr()  # the run's folder made; only the resume's lines below
    assert launch_status(out, "run.resume=auto") == 2
    assert error_lines(capsys.readouterr().err) == (f"{PREFIX}{out / name} is a symbolic link, which no run "
                                                    f"writes; nothing was changed: move it away or choose another "
                                                    f"run.output_dir\n")
    assert outside.read_bytes() == b"the user's own file\n" and tree(out) == before and (out / name).is_symlink()


def test_the_metrics_writer_refuses_a_symlinked_file(tmp_path):
    """The writer's own check, for a link made after the launch checked the folder: no row reaches the target."""
    out, outside = tmp_path / "out", tmp_path / "outside.jsonl"
    died_after_step_2(out)
    outside.write_bytes(b'{"step": 1}\n{"step": 7}\n')
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").symlink_to(outside)
    with pytest.raises(checkpoint.ConfigError) as raised:
        MetricsLogger(out, 4, progress=False, start_step=2)
    assert str(raised.value) == (f"config key 'run.output_dir': {out / 'metrics.jsonl'} is a symbolic link, which no "
                                 f"run writes; nothing was changed: move it away or choose another run.output_dir")
    assert outside.read_bytes() == b'{"step": 1}\n{"step": 7}\n'


@pytest.fixture
def read_only_folder():
    """A folder on a read-only bind mount of itself (root only: mount)."""
    folder = Path(tempfile.mkdtemp())
    mounted = subprocess.run(["mount", "--bind", "-o", "ro", folder, folder], capture_output=True).returncode == 0
    try:
        if not mounted or os.access(folder, os.W_OK):
            pytest.skip("a read-only bind mount needs root")
        yield folder
    finally:
        if mounted:
            subprocess.run(["umount", folder], check=True)
        folder.rmdir()


def unwritable(out, where, reason) -> str:
    return f"{PREFIX}'{out}' cannot be written ({where}: {reason}); choose another run.output_dir\n"


@pytest.mark.parametrize("command", ["validate", "launch"])
def test_an_output_dir_under_proc_is_one_line_before_anything_starts(tmp_path, capsys, command):
    assert main([command, "configs/agent_grpo.yaml", "run.output_dir=/proc/x"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == unwritable("/proc/x", "/proc", "No such file or directory")


@pytest.mark.parametrize("command", ["validate", "launch"])
def test_a_read_only_output_dir_is_one_line_before_anything_starts(read_only_folder, capsys, command):
    assert main([command, "configs/agent_grpo.yaml", f"run.output_dir={read_only_folder}"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == unwritable(read_only_folder, read_only_folder, "Read-only file system")
    assert list(read_only_folder.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="running as another user needs root")
def test_an_output_dir_the_user_may_not_write_is_one_line(tmp_path):
    """The CLI as user `nobody`, on a folder of root's (mode 755): root could write anywhere."""
    folder = Path(tempfile.mkdtemp())
    try:
        folder.chmod(0o755)
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                   "nanoverl_async.cli", "validate", "configs/agent_grpo.yaml", f"run.output_dir={folder}/out"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": "/"})
        assert (result.returncode, result.stdout) == (2, "")
        assert result.stderr == unwritable(f"{folder}/out", folder, "Permission denied")
        assert list(folder.iterdir()) == []
    finally:
        folder.rmdir()
