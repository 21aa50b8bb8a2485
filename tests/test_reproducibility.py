"""Reproducible runs (docs/design.md "Reproducible runs"): two seeded synchronous runs with
run.deterministic log the same rewards and losses step by step, and `nanoverl-async replay` on an
asynchronous run recorded with run.record reproduces its final weights bit for bit. Fast tests cover
the record files and the weight comparison; the runs are slow-marked (a few real steps each)."""

import json

import msgpack
import pytest
import torch
from safetensors.torch import save_file

from nanoverl_async.cli import main
from nanoverl_async.config import ConfigError, load_config
from nanoverl_async.launcher import launch
from nanoverl_async.observe.record import compare_weights, read_batches, step_path, write_batch
from tests.synthetic import episodes

SMALL = ("data.prompts_per_step=4", "data.samples_per_prompt=4", "run.progress=false")
LOGGED = ("reward/mean", "reward/std", "learner/loss", "learner/grad_norm", "episodes/length_mean",
          "batch/prompt_indices")


def logged(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{key: row[key] for key in LOGGED} for row in rows]


def test_recorded_batches_read_back_in_order(tmp_path):
    batches = [episodes([(3, [2, 4], 0.0), (5, [1], 1.0), (2, [3, 3, 1], 0.5)], seed=step) for step in range(2)]
    older = tmp_path / "before-2026-11-29"  # a record counted from 0, as metrics.jsonl was
    older.mkdir()
    for step, batch in enumerate(batches, start=1):
        write_batch(tmp_path, step, batch)
        write_batch(older, step - 1, batch)
    for folder in (tmp_path, older):
        read = read_batches(folder, 2, vocab_size=100)
        for recorded, batch in zip(read, batches, strict=True):
            assert [(t.id, t.reward) for t in recorded] == [(t.id, t.reward) for t in batch]
            assert all((r.token_ids == t.token_ids).all() and (r.behaviour_logprobs == t.behaviour_logprobs).all()
                       for r, t in zip(recorded, batch))
    with pytest.raises(ConfigError, match="step_000003.msgpack: missing"):
        read_batches(tmp_path, 3, vocab_size=100)
    step_path(tmp_path, 2).write_bytes(msgpack.packb({"step": 7, "trajectories": []}))
    with pytest.raises(ConfigError, match="step_000002.msgpack: not a recorded batch: holds step 7"):
        read_batches(tmp_path, 2, vocab_size=100)


def test_weight_comparison_finds_one_changed_bit(tmp_path):
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4)}
    for name in ("expected", "same", "changed"):
        (tmp_path / name).mkdir()
    save_file(tensors, tmp_path / "expected" / "model.safetensors")
    save_file(tensors, tmp_path / "same" / "model.safetensors")
    nudged = tensors["b"].clone()
    nudged[2] = torch.nextafter(nudged[2], torch.tensor(2.0))  # the smallest possible change
    save_file({**tensors, "b": nudged}, tmp_path / "changed" / "model.safetensors")
    assert compare_weights(tmp_path / "expected", tmp_path / "same")["identical"] == 2
    result = compare_weights(tmp_path / "expected", tmp_path / "changed")
    assert result["identical"] == 1 and result["first_mismatch"] == "b" and 0 < result["max_abs_diff"] < 1e-6


@pytest.mark.slow
def test_two_seeded_synchronous_runs_log_the_same_metrics(ray_session, tmp_path):
    """In this process, one Ray instance for both (as bench/ does): every role is a new actor each run."""
    runs = []
    for name in ("first", "second"):
        launch(load_config("configs/agent_grpo.yaml", [f"run.output_dir={tmp_path / name}", "run.total_steps=4",
                                                       "staleness.max=0", "run.deterministic=true", "run.seed=5",
                                                       *SMALL]))
        runs.append(logged(tmp_path / name))
    assert runs[0] == runs[1]
    assert len({row["reward/mean"] for row in runs[0]}) > 1  # the runs learned something, not a constant


@pytest.mark.slow
def test_replay_of_a_recorded_async_run_gives_its_final_weights(observed_run, ray_session, capsys):
    """conftest.py's run: 4 steps at staleness.max=1 on two generators, run.record=true. The CLI's replay in
    this process, on the session's Ray instance."""
    staleness = [json.loads(line)["staleness/max"] for line in (observed_run / "metrics.jsonl").read_text().splitlines()]
    assert max(staleness) >= 1  # the stream really was off-policy
    assert main(["replay", str(observed_run)]) == 0
    assert "bit for bit" in capsys.readouterr().out
    result = compare_weights(observed_run / "final", observed_run / "replay" / "final")
    assert result["identical"] == result["tensors"] > 0
