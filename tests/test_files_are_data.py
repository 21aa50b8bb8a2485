"""Files a run loads are data, never code: a learner checkpoint (DCP), the buffer's state, the records
`nanoverl-async replay` reads and PyTorch-pickled model weights. Each crafted file below would run
`os.system("touch MARKER")` if it were unpickled; it is refused in one line naming it, and the marker
never appears. Values out of range (a token id beyond the vocabulary) are named with their file and field.

The learner cases use one process and a plain model (DCP without a process group); the 1- and 2-rank
FSDP2 round trip is tests/test_checkpoint.py. Run alone: `python -m pytest tests/test_files_are_data.py -q`.
"""

import os
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.state_dict import get_state_dict

from nanoverl_async.buffer.service import BufferService
from nanoverl_async.config import BufferConfig, ConfigError, GeneratorConfig, load_config
from nanoverl_async.launcher import launch
from nanoverl_async.learners.checkpoint import load_training_state, save_training_state
from nanoverl_async.models.load import resolve_model_path
from nanoverl_async.observe.record import read_batches, step_path, write_batch
from nanoverl_async.wire.trajectory import encode
from test_fsdp import write_model_dir
from test_replay import make_trajectory

RESUME_HINT = "resume from another checkpoint (run.resume=<its step_N folder>)"
CODE = "its pickle calls posix.system: code, not data"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process


class RunsCode:
    """Unpickled, runs `touch marker`: what a crafted file would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def learner(lr: float = 1e-2, steps: int = 1) -> SimpleNamespace:
    """What learners/checkpoint.py reads of a LearnerRank: a policy and its AdamW, after `steps` steps."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        model(torch.ones(2, 4)).square().sum().backward()
        optimizer.step()
    return SimpleNamespace(model=model, optimizer=optimizer, critic=None, critic_optimizer=None)


def save_whole_state(folder: Path, replace: dict = ()) -> Path:
    """A learner checkpoint as the code before this one wrote it: models and optimizers with their
    param_groups; `replace`: model state dict key -> another value (a pickled object where a tensor was)."""
    rank = learner()
    model_state, optimizer_state = get_state_dict(rank.model, rank.optimizer)
    dcp.save({"policy": {"model": {**model_state, **dict(replace)}, "optimizer": optimizer_state}},
             checkpoint_id=str(folder))
    return folder


def rewrite_index(folder: Path, change) -> None:
    """`change(metadata)` DCP's .metadata, a file this test wrote (so pickle may read it here)."""
    index = folder / ".metadata"
    metadata = pickle.loads(index.read_bytes())
    change(metadata)
    index.write_bytes(pickle.dumps(metadata))


def refused(where, reason: str) -> str:
    return f"config key 'run.resume': {where} is not a valid checkpoint ({reason}); {RESUME_HINT}"


# ---- the learner checkpoint (DCP) ----

def test_a_saved_learner_state_loads_back_and_holds_tensors_only(tmp_path):
    saved = learner(steps=2)
    save_training_state(saved, str(tmp_path / "learner"))
    loaded = learner(lr=5e-3)  # one step: other weights and moments; a resumed run may change learner.lr
    load_training_state(loaded, str(tmp_path / "learner"))
    for name in ("weight", "bias"):
        mine, theirs = getattr(loaded.model, name), getattr(saved.model, name)
        assert torch.equal(mine, theirs)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded.optimizer.state[mine][key], saved.optimizer.state[theirs][key]), (name, key)
    assert loaded.optimizer.state[loaded.model.weight]["step"].item() == 2
    assert loaded.optimizer.param_groups[0]["lr"] == 5e-3  # the config's, not the checkpoint's
    index = pickle.loads((tmp_path / "learner" / ".metadata").read_bytes())
    assert sorted(type(entry).__name__ for entry in index.state_dict_metadata.values()) == ["TensorStorageMetadata"] * 8


def test_a_checkpoint_with_param_groups_still_loads(tmp_path):
    """Written before param_groups were left out: its pickled param_groups are never read."""
    folder = save_whole_state(tmp_path / "learner")
    loaded = learner(lr=5e-3)
    torch.nn.init.zeros_(loaded.model.weight)
    load_training_state(loaded, str(folder))
    assert torch.equal(loaded.model.weight, learner().model.weight)
    assert loaded.optimizer.param_groups[0]["lr"] == 5e-3


def test_a_crafted_index_is_refused_without_running_it(tmp_path):
    folder, marker = save_whole_state(tmp_path / "learner"), tmp_path / "MARKER"
    (folder / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(ConfigError) as raised:
        load_training_state(learner(), str(folder))
    assert str(raised.value) == refused(folder / ".metadata", CODE)
    assert not marker.exists()


def test_an_index_that_is_not_dcp_metadata_is_refused(tmp_path):
    folder = save_whole_state(tmp_path / "learner")
    (folder / ".metadata").write_bytes(pickle.dumps({"storage_data": {}}))
    with pytest.raises(ConfigError) as raised:
        load_training_state(learner(), str(folder))
    assert str(raised.value) == refused(folder / ".metadata", "TypeError: it holds a dict, not DCP's Metadata")


def test_a_pickled_object_where_a_tensor_belongs_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "MARKER"
    folder = save_whole_state(tmp_path / "learner", replace={"weight": RunsCode(marker)})
    with pytest.raises(ConfigError) as raised:
        load_training_state(learner(), str(folder))
    assert str(raised.value) == refused(folder / ".metadata",
                                        "it stores policy.model.weight as a pickled object, not a tensor")
    assert not marker.exists()


def test_a_crafted_tensor_record_is_refused_without_running_it(tmp_path):
    folder, marker = save_whole_state(tmp_path / "learner"), tmp_path / "MARKER"
    torch.save(RunsCode(marker), folder / "crafted.distcp")
    size = (folder / "crafted.distcp").stat().st_size

    def point_weight_at_crafted_file(metadata):
        (index,) = [i for i in metadata.storage_data if i.fqn == "policy.model.weight"]
        metadata.storage_data[index] = _StorageInfo("crafted.distcp", 0, size)

    rewrite_index(folder, point_weight_at_crafted_file)
    with pytest.raises(ConfigError) as raised:
        load_training_state(learner(), str(folder))
    assert str(raised.value) == refused(folder, CODE)
    assert not marker.exists()


def test_an_index_naming_a_file_outside_its_folder_is_refused(tmp_path):
    folder = save_whole_state(tmp_path / "learner")
    shutil.copy(folder / "__0_0.distcp", tmp_path / "elsewhere.distcp")  # loadable: only where it lies is wrong

    def point_outside(metadata):
        for index, info in metadata.storage_data.items():
            metadata.storage_data[index] = _StorageInfo("../elsewhere.distcp", info.offset, info.length)

    rewrite_index(folder, point_outside)
    with pytest.raises(ConfigError) as raised:
        load_training_state(learner(), str(folder))
    assert str(raised.value) == refused(folder / ".metadata", "ValueError: it names '../elsewhere.distcp', not a "
                                                              "file of its folder")


# ---- the buffer's state (buffer.msgpack) ----

VOCAB = 110


def buffer_service() -> BufferService:
    return BufferService(1, 1, 0, BufferConfig(lease_timeout_s=30), "127.0.0.1", GeneratorConfig(), VOCAB,
                         lambda i: {"index": i})


def buffer_state_with(token_id: int, version: int = 3) -> bytes:
    """buffer.msgpack at version 3 with one complete group whose last token is `token_id`, sampled by weights
    `version` (added past the wire's checks, as a crafted file could hold it)."""
    service = buffer_service()
    try:
        (lease,) = service.gate.lease(version=3, max_groups=1, now=0.0)
        service.replay.open(lease.group_id, lease.prompt_index, 3)
        trajectory = make_trajectory(lease.group_id, lease.prompt_index, 0, [version])
        trajectory.token_ids = np.array([1, 2, token_id], dtype=np.int32)
        service.replay.add(trajectory)
        service.gate.complete(lease.group_id)
        return service.state_bytes(version=3)
    finally:
        service.close()


@pytest.mark.parametrize("token_id,version,problem", [
    (VOCAB, 3, "WireError: field 'token_ids': id 110 >= vocabulary size 110"),
    (10**6, 3, "WireError: field 'token_ids': id 1000000 >= vocabulary size 110"),
    (VOCAB - 1, 4, "WireError: field 'versions': version 4 was never published (newest: 3)"),
])
def test_a_restored_trajectory_out_of_range_names_the_file_and_field(token_id, version, problem):
    at_bounds, service = buffer_service(), buffer_service()
    try:
        at_bounds.restore(buffer_state_with(VOCAB - 1, version=3))
        assert [t.token_ids.tolist() for g in at_bounds.replay.ready.values() for t in g.trajectories] == [[1, 2, 109]]
        with pytest.raises(ValueError) as raised:
            service.restore(buffer_state_with(token_id, version))
    finally:
        at_bounds.close()
        service.close()
    assert str(raised.value) == f"checkpoint file buffer.msgpack is not a buffer state ({problem})"


@pytest.mark.parametrize("data,problem", [
    (msgpack.packb({"format": 2, "version": 3})[:-1], "ValueError: Unpack failed: incomplete input"),  # truncated
    (msgpack.packb([2]), "AttributeError: 'list' object has no attribute 'get'"),
    (msgpack.packb({"format": 2, "version": 0}), "KeyError: 'gate'"),
])
def test_a_buffer_state_that_is_not_one_is_one_line_naming_the_file(data, problem):
    service = buffer_service()
    try:
        with pytest.raises(ValueError) as raised:
            service.restore(data)
    finally:
        service.close()
    assert str(raised.value) == f"checkpoint file buffer.msgpack is not a buffer state ({problem})"


# ---- the records `nanoverl-async replay` reads ----

def record_step_0(tmp_path, token_id: int, version: int = 0) -> Path:
    """record/step_000000.msgpack with two trajectories, the second's last token `token_id` from weights
    `version` (written past the buffer's checks, as a crafted file could hold it)."""
    second = make_trajectory(0, 0, 1, [version])
    second.token_ids[-1] = token_id
    write_batch(tmp_path, 0, [make_trajectory(0, 0, 0, [0]), second])
    return step_path(tmp_path, 0)


@pytest.mark.parametrize("token_id,version,problem", [
    (10**6, 0, "field 'token_ids': id 1000000 >= vocabulary size 100"),
    (100, 0, "field 'token_ids': id 100 >= vocabulary size 100"),
    (99, 1, "field 'versions': version 1 was never published (newest: 0)"),
])
def test_a_recorded_trajectory_out_of_range_names_the_file_and_field(tmp_path, token_id, version, problem):
    record_step_0(tmp_path, token_id=99, version=0)  # at the bounds: read back
    assert [int(t.token_ids[-1]) for t in read_batches(tmp_path, 1, vocab_size=100)[0]] == [2, 99]
    path = record_step_0(tmp_path, token_id, version)
    with pytest.raises(ConfigError) as raised:
        read_batches(tmp_path, 1, vocab_size=100)
    assert str(raised.value) == f"{path}: not a recorded batch: trajectory 1: {problem}"


def test_a_recorded_trajectory_longer_than_the_run_allows_is_named(tmp_path):
    path = record_step_0(tmp_path, token_id=5)
    assert len(read_batches(tmp_path, 1, vocab_size=100, max_tokens=3)[0]) == 2  # 3 tokens each: at the limit
    with pytest.raises(ConfigError) as raised:
        read_batches(tmp_path, 1, vocab_size=100, max_tokens=2)
    assert str(raised.value) == (f"{path}: not a recorded batch: trajectory 0: field 'token_ids': 3 tokens, more "
                                 f"than the run's 2 (agent.max_total_tokens)")


# ---- PyTorch-pickled model weights (pytorch_model.bin) ----

def pickled_weights_dir(tmp_path, extra: dict = ()) -> Path:
    """The tiny model with its weights as pytorch_model.bin (no safetensors), plus `extra` entries."""
    directory = Path(write_model_dir(tmp_path / "model"))
    state = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    torch.save({**state, **dict(extra)}, directory / "pytorch_model.bin")
    return directory


def test_pickled_weights_that_call_code_are_refused_naming_the_file(tmp_path):
    marker = tmp_path / "MARKER"
    directory = pickled_weights_dir(tmp_path / "tensors")
    assert resolve_model_path(str(directory)) == str(directory)  # tensors only: loads
    # transformers reads safetensors first, and training_args.bin is no weights file: neither pickle is read
    beside = Path(write_model_dir(tmp_path / "beside" / "model"))
    torch.save({"x": RunsCode(marker)}, beside / "training_args.bin")
    torch.save({"x": RunsCode(marker)}, beside / "pytorch_model.bin")
    assert resolve_model_path(str(beside)) == str(beside)
    directory = pickled_weights_dir(tmp_path / "code", {"lm_head.extra": RunsCode(marker)})
    message = (f"{directory / 'pytorch_model.bin'} is not weights a run can load ({CODE}); save them as "
               f"safetensors, or with torch.save of the state dict alone")
    with pytest.raises(ValueError) as raised:
        resolve_model_path(str(directory))
    assert str(raised.value) == message
    cfg = load_config("configs/agent_grpo.yaml", [f"model.path={directory}", f"run.output_dir={tmp_path / 'out'}"])
    with pytest.raises(ConfigError) as raised:
        launch(cfg)
    assert str(raised.value) == f"config key 'model.path': {message}"
    assert not marker.exists()
