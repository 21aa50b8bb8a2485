"""The learner's input stream on disk (run.record), and the check that replaying it gives the same weights.

    nanoverl-async launch configs/agent_grpo.yaml run.record=true   # writes <output_dir>/record/
    nanoverl-async replay outputs/agent_grpo                        # the learner alone, on that stream

An asynchronous run cannot be repeated: which episodes land in which batch depends on how fast each role
ran. What the learner consumed can be kept, though, and the learner is deterministic given its batches
(the minibatch order is seeded by version, learners/batch.py `epoch_order`; no dropout). So a run with
run.record=true writes every batch it trains on, in the order and form it was trained on, and
`nanoverl-async replay RUN_DIR` (controller/replay.py) feeds them to freshly placed learners and compares the
resulting weights with the run's final/, tensor by tensor and bit for bit (both saved in model.dtype: in a
bfloat16 run a difference below bfloat16's rounding goes unseen). A mismatch means the learner
itself is not a function of its input (a kernel, a world size, a changed library), which separates a
learner divergence from a generation one.

Layout: `record/step_NNNNNN.msgpack`, one per training step, counted from 1 as metrics.jsonl counts them (a
record before 2026-11-29 counts from 0, and is read so): {"step": int, "trajectories": [bytes]}, each
trajectory in its wire form (trajectory.encode), in batch order. A resumed run rewrites the steps from its
checkpoint on, so the folder always holds the history that produced final/. The files are data: each
trajectory is read back as the buffer reads one off the wire (decode, check_bounds), so a bad one is named
with its file and field before the learner sees it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import msgpack
import torch
from safetensors.torch import load_file

from nanoverl_async import checkpoint
from nanoverl_async.config import ConfigError
from nanoverl_async.wire.trajectory import Trajectory, WireError, check_bounds, decode, encode


def step_path(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "record" / f"step_{step:06d}.msgpack"


def write_batch(output_dir: str | Path, step: int, trajectories: list[Trajectory]) -> None:
    """Step `step`'s batch, written to a temporary name and renamed, so a crash never leaves half a file."""
    path = step_path(output_dir, step)
    checkpoint.claim(output_dir, path.parent.name).mkdir(exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_bytes(msgpack.packb({"step": step, "trajectories": [encode(t) for t in trajectories]}))
    partial.replace(path)


def read_batches(output_dir: str | Path, total_steps: int, vocab_size: int,
                 max_tokens: Optional[int] = None) -> list[list[Trajectory]]:
    """Steps 1..total_steps as recorded, each trajectory valid and within the run's bounds: token ids below
    the model's `vocab_size`, at most `max_tokens` tokens, none sampled by weights newer than those its step
    updated (version step - 1); ConfigError naming the first missing or bad file, trajectory and field."""
    batches = []
    first = 0 if step_path(output_dir, 0).is_file() else 1  # 0: recorded before 2026-11-29
    for version in range(total_steps):  # the weights the step's batch updated
        step = first + version
        path, where = step_path(output_dir, step), ""
        if not path.is_file():
            raise ConfigError(f"{path}: missing; replay needs every step of a run launched with run.record=true")
        try:
            record = msgpack.unpackb(path.read_bytes(), raw=False)
            if record.get("step") != step:
                raise WireError(f"holds step {record.get('step')!r}")
            batches.append([])
            for i, message in enumerate(record["trajectories"]):
                where = f"trajectory {i}: "
                batches[-1].append(decode(message))
                check_bounds(batches[-1][-1], vocab_size, version, max_tokens)
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ConfigError(f"{path}: not a recorded batch: {where}{error}") from None
    return batches


def compare_weights(expected_dir: str | Path, actual_dir: str | Path) -> dict:
    """Every tensor of the safetensors files in `expected_dir` against `actual_dir`: how many match bit
    for bit, the first that does not, and the largest absolute difference."""
    expected, actual = _tensors(expected_dir), _tensors(actual_dir)
    if set(expected) != set(actual):
        return {"tensors": len(expected), "identical": 0, "first_mismatch": "tensor names differ", "max_abs_diff": None}
    differing = [name for name in sorted(expected) if not torch.equal(expected[name], actual[name])]
    max_diff = max(((expected[n].double() - actual[n].double()).abs().max().item() for n in differing), default=0.0)
    return {"tensors": len(expected), "identical": len(expected) - len(differing),
            "first_mismatch": differing[0] if differing else "", "max_abs_diff": max_diff}


def _tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder}: no *.safetensors weights to compare")
    return {name: tensor for file in files for name, tensor in load_file(str(file)).items()}
