"""Checkpoint and resume, piece by piece: the buffer's state with leases in flight, the learner's DCP
state on 1 and 2 gloo ranks, the checkpoint folders (atomic, pruned, found by resume=auto) and the
config errors. The real CLI run, saved and resumed, is in tests/test_cli_run.py.
"""

import json

import msgpack
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import HealthCheck, settings
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from nanoverl_async import checkpoint
from nanoverl_async.buffer.gate import AdmissionGate
from nanoverl_async.buffer.replay import STRAGGLER, ReplayBuffer
from nanoverl_async.buffer.service import BufferService
from nanoverl_async.config import (AlgorithmConfig, BufferConfig, ConfigError, CriticConfig, GeneratorConfig, KLConfig,
                                   RunConfig, load_config)
from nanoverl_async.learners.batch import collate, with_advantages
from nanoverl_async.learners.checkpoint import full_state_dict
from nanoverl_async.learners.fsdp_rank import LearnerRank
from nanoverl_async.observe.metrics import MetricsLogger
from nanoverl_async.controller.preflight import inspect_output, prepare
from synthetic import episodes
from test_fsdp import free_port, setup, write_model_dir
from test_replay import TIMEOUT, GateAndReplay, fill


# ---- the buffer: nothing lost or doubled across a save and restore with leases in flight ----

def round_trip(gate: AdmissionGate, replay: ReplayBuffer, version: int) -> tuple[AdmissionGate, ReplayBuffer]:
    """What BufferService.state_bytes / restore do, without sockets: state -> msgpack -> a fresh pair."""
    data = msgpack.packb({"gate": gate.state(), "replay": replay.state()}, use_bin_type=True)
    state = msgpack.unpackb(data, raw=False, strict_map_key=False)
    new_gate = AdmissionGate(gate.prompts_per_step, gate.staleness, gate.lease_timeout_s, gate.prompt_fn)
    new_replay = ReplayBuffer(replay.group_size, replay.group_filter)
    new_replay.restore(state["replay"], new_gate.restore(state["gate"], version, now=0.0))
    return new_gate, new_replay


class GateAndReplayWithRestarts(GateAndReplay):
    """tests/test_replay.py's random interleavings, plus a save-and-restore at random moments: the
    frontier invariants (every prompt in exactly one place, each consumed at most once) must hold
    across it, in-flight prompts are re-issued once, and their old episodes arrive as stragglers."""

    EVENTS = GateAndReplay.EVENTS + ["restart"]

    def restart(self, data):
        before = self.gate.frontier()
        in_flight = [g for g, lease in self.gate.live.items() if not lease.complete]
        ready = {g: [t.id for t in group.trajectories] for g, group in self.replay.ready.items()}
        self.gate, self.replay = round_trip(self.gate, self.replay, self.version)
        after = self.gate.frontier()
        assert after["next_index"] == before["next_index"]
        assert after["reissue"] == before["reissue"] + [before["live"][g] for g in in_flight]
        assert {g: [t.id for t in group.trajectories] for g, group in self.replay.ready.items()} == ready
        self.expired.update(in_flight)  # their episodes died with the old run: any late one is a straggler
        # the pool publishes the restored weights at start: every generator holds the learner's version
        self.generator_versions = [self.version] * len(self.generator_versions)
        if self.version:  # a generator still on older weights gets nothing
            assert self.gate.lease(self.version - 1, 1, self.now) == []


GateAndReplayWithRestarts.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                                       suppress_health_check=[HealthCheck.too_slow])
test_buffer_state_survives_restarts_at_random_moments = GateAndReplayWithRestarts.TestCase


def test_restored_buffer_reissues_in_flight_prompt_once_and_keeps_complete_groups():
    B, G, eta = 2, 2, 1
    gate, replay = AdmissionGate(B, eta, TIMEOUT, prompt_fn=lambda i: {"index": i}), ReplayBuffer(G)
    leases = gate.lease(version=0, max_groups=4, now=0.0)
    for lease in leases:
        replay.open(lease.group_id, lease.prompt_index, lease.version)
    fill(replay, leases[0].group_id, leases[0].prompt_index, [0, 0])  # complete
    gate.complete(leases[0].group_id)
    fill(replay, leases[1].group_id, leases[1].prompt_index, [0])  # partial: one episode of two finished
    gate2, replay2 = round_trip(gate, replay, version=0)
    assert replay2.state()["partial"] == []  # the partial group went with its lease
    assert replay.state()["partial"][0][4]  # ... though the saved file did hold its finished episode
    assert list(gate2.live) == [leases[0].group_id] and list(replay2.ready) == [leases[0].group_id]
    assert gate2.frontier()["reissue"] == [1, 2, 3] and gate2.groups_started == 1
    again = gate2.lease(version=0, max_groups=4, now=0.0)
    assert [lease.prompt_index for lease in again] == [1, 2, 3]  # re-issued once each, before fresh ones
    assert replay2.add(replay.open_groups[leases[1].group_id].trajectories[0]) == STRAGGLER


def test_buffer_service_state_bytes_round_trip_and_min_version():
    def service():
        return BufferService(1, 1, 0, BufferConfig(lease_timeout_s=30), "127.0.0.1", GeneratorConfig(), 110,
                             lambda i: {"index": i})

    old, new = service(), service()
    try:
        (lease,) = old.gate.lease(version=3, max_groups=1, now=0.0)
        old.replay.open(lease.group_id, lease.prompt_index, 3)
        new.restore(old.state_bytes(version=3))
        assert new.gate.frontier() == {"next_index": 1, "reissue": [0], "live": {}}
        assert new.gate.lease(version=2, max_groups=1, now=0.0) == []  # below the checkpoint's weights
        assert [l.prompt_index for l in new.gate.lease(version=3, max_groups=1, now=0.0)] == [0]
        with pytest.raises(ValueError, match="format"):
            service_state = msgpack.packb({"format": 99})
            old.restore(service_state)
    finally:
        old.close()
        new.close()


# ---- the learner: DCP save/load gives exactly the next update a run without it gives ----

GAE = AlgorithmConfig(advantage="gae", gamma=1.0, lam=1.0)
GRPO = AlgorithmConfig(is_cap=1.5)


def prepared(learner, world_size, algo, seed):
    """A batch with advantages (and the critic's values for gae), as LearnerPool.prepare makes it."""
    batch = collate(episodes([(3, [4, 2], 1.0), (3, [5], 0.0), (4, [2, 3], 0.0), (4, [6], 1.0)], seed=seed))
    if algo.advantage == "gae":
        parts = [None] * world_size
        dist.all_gather_object(parts, learner.compute(batch, "values"))
        batch.values = torch.from_numpy(np.concatenate(parts))
    return with_advantages(batch, 2, algo, KLConfig(), max_total_tokens=16)


def snapshot(learner) -> dict:
    """Collective: full policy (and critic) weights on rank 0, copied (on one CPU rank the full state
    dict is the live parameters themselves)."""
    out = {"policy": full_state_dict(learner.model)}
    if learner.critic is not None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        out["critic"] = get_model_state_dict(learner.critic, options=options)
    return {part: {key: tensor.clone() for key, tensor in state.items()} for part, state in out.items()}


def save_then_resume(rank, world_size, ports, model_dir, out_dir, algo):
    """Update, save, update (the reference); then fresh ranks load the save and make the same update."""
    def make(port):
        critic = CriticConfig(lr=1e-2) if algo.advantage == "gae" else CriticConfig()
        return LearnerRank(setup(model_dir, algo, world_size=world_size, critic=critic), rank, "127.0.0.1", port)

    learner = make(ports[0])
    learner.update(prepared(learner, world_size, algo, seed=0), 0)  # Adam moments are no longer zero
    learner.save_checkpoint(f"{out_dir}/learner")
    saved = snapshot(learner)
    learner.update(prepared(learner, world_size, algo, seed=1), 1)
    expected = snapshot(learner)
    learner.shutdown()
    learner = make(ports[1])  # fresh weights and optimizer
    learner.load_checkpoint(f"{out_dir}/learner")
    loaded = snapshot(learner)
    metrics = learner.update(prepared(learner, world_size, algo, seed=1), 1)
    resumed = snapshot(learner)
    learner.shutdown()
    if rank == 0:
        torch.save({"saved": saved, "loaded": loaded, "expected": expected, "resumed": resumed,
                    "version": metrics["version"]}, f"{out_dir}/result.pt")


def worker(rank, ports, model_dir, out_dir):
    """2 ranks with a critic (gae), then (saving a process start) rank 0 alone with GRPO."""
    save_then_resume(rank, 2, ports[:2], model_dir, f"{out_dir}/two", GAE)
    if rank == 0:
        save_then_resume(0, 1, ports[2:], model_dir, f"{out_dir}/one", GRPO)


def test_learner_dcp_save_load_gives_the_same_next_update(tmp_path):
    model_dir = write_model_dir(tmp_path / "model")
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    mp.spawn(worker, args=([free_port() for _ in range(4)], model_dir, str(tmp_path)), nprocs=2, join=True)
    for name, parts in (("one", ["policy"]), ("two", ["policy", "critic"])):
        result = torch.load(tmp_path / name / "result.pt")
        assert result["version"] == 2
        for part in parts:
            saved, resumed = result["saved"][part], result["resumed"][part]
            for key, tensor in saved.items():
                assert torch.equal(result["loaded"][part][key], tensor), (name, part, key)
                assert torch.equal(resumed[key], result["expected"][part][key]), (name, part, key)
            assert any(not torch.equal(resumed[key], tensor) for key, tensor in saved.items())  # it did train


# ---- the folders: atomic, pruned, found by run.resume=auto; and the config errors ----

def fake_save(output_dir, step, keep=2):
    folder = checkpoint.begin(str(output_dir), step)
    write_state_files(folder)
    return checkpoint.commit(folder, {"step": step, "seed": 0, "config": {}}, keep)


def write_state_files(folder):
    """Stand-ins for what the roles write: DCP's index of the learner shards and the buffer's state."""
    (folder / "learner").mkdir()
    (folder / "learner" / ".metadata").write_bytes(b"x")
    (folder / "buffer.msgpack").write_bytes(b"x")


def test_folders_are_published_whole_pruned_and_found_by_auto(tmp_path):
    run = RunConfig(output_dir=str(tmp_path), resume="auto")
    assert checkpoint.find_checkpoint(run) is None  # auto before any checkpoint: a fresh run
    for step in (2, 4, 6):
        fake_save(tmp_path, step)
    crashed = checkpoint.begin(str(tmp_path), 8)  # a save that died before its rename
    (crashed / "meta.json").write_text(json.dumps({"step": 8}))
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [".step_8.tmp", "step_4", "step_6"]
    assert checkpoint.find_checkpoint(run) == root / "step_6"
    assert checkpoint.read_meta(root / "step_6") == {"step": 6, "seed": 0, "config": {}}
    fake_save(tmp_path, 8, keep=0)  # the leftover .tmp is cleared; keep=0 keeps all
    assert sorted(p.name for p in root.iterdir()) == ["step_4", "step_6", "step_8"]
    explicit = RunConfig(output_dir=str(tmp_path), resume=str(root / "step_4"))
    assert checkpoint.find_checkpoint(explicit) == root / "step_4"


@pytest.mark.parametrize("first", [1, 0], ids=["counted-from-1", "counted-from-0-before-2026-11-29"])
def test_resumed_metrics_keep_each_step_once(tmp_path, first):
    """A run that saved step_4, logged step 5, then crashed writing step 6's row, resumed: steps 1-4 kept, then 5;
    an older run's rows, counted from 0 (learner/version one ahead), are counted as now when the file is rewritten."""
    logger = MetricsLogger(tmp_path, 6, progress=False)
    for step in range(first, first + 5):
        logger.file.write(json.dumps({"step": step, "learner/version": step + 1 - first}) + "\n")
    logger.file.write(f'{{"step": {first + 5}, "rew')
    logger.close()
    logger = MetricsLogger(tmp_path, 6, progress=False, start_step=4)
    logger.file.write(json.dumps({"step": 5, "learner/version": 5}) + "\n")
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row["learner/version"]) for row in rows] == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]


@pytest.mark.parametrize("override, key", [
    ("run.save_every=-1", "run.save_every"),
    ("run.keep_checkpoints=-2", "run.keep_checkpoints"),
    ("run.resume=/nonexistent/step_3", "run.resume"),
])
def test_bad_checkpoint_keys_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        prepare(load_config("configs/agent_grpo.yaml", [override]))  # values at load, the checkpoint at launch


def test_resume_needs_a_checkpoint_folder(tmp_path):
    (tmp_path / "step_2").mkdir()  # no meta.json: not a checkpoint
    with pytest.raises(ConfigError, match=r"run\.resume.*not a checkpoint"):
        prepare(load_config("configs/agent_grpo.yaml", [f"run.resume={tmp_path / 'step_2'}"]))


def saved_run(output_dir, step: int, *overrides: str):
    """A checkpoint of step `step` as a run with `overrides` writes it (meta.json with the real config), in a
    folder the run opened (and so marked) first."""
    cfg = load_config("configs/agent_grpo.yaml", [f"run.output_dir={output_dir}", *overrides])
    if not (output_dir / checkpoint.MARKER).exists():
        opened(cfg)
    folder = checkpoint.begin(str(output_dir), step)
    write_state_files(folder)
    return checkpoint.commit(folder, checkpoint.make_meta(cfg, step, {}), 2)


def launch_config(output_dir, *overrides: str):
    return load_config("configs/agent_grpo.yaml", [f"run.output_dir={output_dir}", *overrides])


def opened(cfg):
    """run.output_dir made ready for a launch of `cfg` as launch makes it (the plan's inspection, then
    checkpoint.open_output_dir); the checkpoint it resumes, None for a fresh run."""
    found = inspect_output(cfg)
    checkpoint.open_output_dir(cfg, found)
    return found.resume_from


def marker(output_dir) -> dict:
    return json.loads((output_dir / checkpoint.MARKER).read_text())


def test_a_fresh_run_never_reuses_an_output_dir_silently(tmp_path):
    """The lost-run bug: a second fresh run into the same directory overwrote metrics.jsonl and config.yaml
    and kept the first run's checkpoints, which a later resume=auto then mixed in under another seed."""
    saved_run(tmp_path, 4)
    checkpoint.claim(tmp_path, "metrics.jsonl").write_text('{"step": 1}\n')
    first = marker(tmp_path)
    assert first["entries"] == ["checkpoints", "metrics.jsonl"]  # what the run created, as it created it
    for resume in ((), ("run.resume=''",)):
        with pytest.raises(ConfigError, match=r"run\.output_dir.*already holds a run.*run\.resume=auto.*"
                                              r"run\.overwrite=true"):
            opened(launch_config(tmp_path, *resume))
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'  # nothing touched
    assert opened(launch_config(tmp_path, "run.resume=auto", "run.total_steps=6")) \
        == tmp_path / "checkpoints" / "step_4"
    assert marker(tmp_path) == first  # a resume is the same run
    assert opened(launch_config(tmp_path, "run.overwrite=true")) is None
    assert [p.name for p in tmp_path.iterdir()] == [checkpoint.MARKER]  # cleared: the fresh run starts clean
    assert marker(tmp_path)["entries"] == [] and marker(tmp_path)["run_id"] != first["run_id"]
    assert opened(launch_config(tmp_path / "new")) is None  # created, marked, empty
    assert [p.name for p in (tmp_path / "new").iterdir()] == [checkpoint.MARKER]
    with pytest.raises(ConfigError, match=r"run\.overwrite.*run\.resume"):
        launch_config(tmp_path, "run.overwrite=true", "run.resume=auto")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"run\.output_dir.*is a file"):
        opened(launch_config(tmp_path / "file"))


def test_resume_refuses_another_lineage_and_says_what_changed(tmp_path):
    saved_run(tmp_path, 4, "run.seed=1")
    with pytest.raises(ConfigError, match=r"another run \(other run\.seed\)"):
        opened(launch_config(tmp_path, "run.resume=auto", "run.seed=2"))
    with pytest.raises(ConfigError, match=r"another run \(other model\.path\)"):
        opened(launch_config(tmp_path, "run.resume=auto", "run.seed=1", "model.path=/elsewhere"))
    assert opened(launch_config(tmp_path, "run.resume=auto", "run.seed=1", "learner.lr=1e-3"))


def test_resume_finishes_a_run_that_died_before_final(tmp_path):
    """The last step's checkpoint is committed but final/ is missing: resuming with the same total_steps
    writes final/ (zero steps to train); once final/ exists the run is done."""
    saved_run(tmp_path, 4)
    assert opened(launch_config(tmp_path, "run.resume=auto", "run.total_steps=4"))
    checkpoint.claim(tmp_path, "final").mkdir()  # a final/ without its model (an older version wrote it in place)
    assert opened(launch_config(tmp_path, "run.resume=auto", "run.total_steps=4"))
    checkpoint.publish_final(tmp_path, write_final_files)
    with pytest.raises(ConfigError, match=r"run\.total_steps.*already done"):
        opened(launch_config(tmp_path, "run.resume=auto", "run.total_steps=4"))
    with pytest.raises(ConfigError, match=r"run\.total_steps.*already done"):
        opened(launch_config(tmp_path, "run.resume=auto", "run.total_steps=3"))


def write_final_files(folder):
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x")


def test_auto_resumes_the_newest_step_by_number_not_by_name(tmp_path):
    for step in (9, 10):
        fake_save(tmp_path, step, keep=0)
    assert checkpoint.find_checkpoint(RunConfig(output_dir=str(tmp_path), resume="auto")) \
        == tmp_path / "checkpoints" / "step_10"


def test_keep_checkpoints_prunes_the_oldest_by_step_number_not_by_name(tmp_path):
    """By name, step_10 sorts before step_8: keeping the two "newest" would keep step_8 and step_9."""
    for step in (8, 9):
        fake_save(tmp_path, step, keep=0)
    fake_save(tmp_path, 10, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_10", "step_9"]


def test_overwrite_refuses_a_folder_that_holds_the_users_files_and_deletes_nothing(tmp_path):
    saved_run(tmp_path, 4)
    (tmp_path / "thesis.txt").write_text("years of work")
    with pytest.raises(ConfigError, match=r"run\.output_dir.*thesis\.txt was not written by the run there "
                                          r"\(\.nanoverl-run\.json does not list it\); nothing was changed"):
        opened(launch_config(tmp_path, "run.overwrite=true"))
    assert (tmp_path / "thesis.txt").read_text() == "years of work"
    assert checkpoint.is_checkpoint(tmp_path / "checkpoints" / "step_4")


def test_overwrite_clears_exactly_what_a_run_wrote(tmp_path):
    saved_run(tmp_path, 4)
    checkpoint.begin(str(tmp_path), 6)  # a save that died
    checkpoint.publish_final(tmp_path, write_final_files)
    for name in ("config.yaml", "metrics.jsonl", "samples.jsonl", "trace.json"):
        checkpoint.claim(tmp_path, name).write_text("x")
    (tmp_path / "checkpoints" / "notes.txt").write_text("mine")  # one file of the user's, deep inside
    with pytest.raises(ConfigError, match=r"notes\.txt, which no run writes"):
        opened(launch_config(tmp_path, "run.overwrite=true"))
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "final" / "config.json").exists()
    (tmp_path / "checkpoints" / "notes.txt").unlink()
    outside = tmp_path.parent / f"{tmp_path.name}-kept"
    outside.mkdir()
    (outside / "kept.txt").write_text("x")
    checkpoint.claim(tmp_path, "record").symlink_to(outside)  # listed, then made a link: refused, not followed
    with pytest.raises(ConfigError, match=r"record is a symbolic link, which no run writes; nothing was changed"):
        opened(launch_config(tmp_path, "run.overwrite=true"))
    assert (tmp_path / "metrics.jsonl").exists() and (outside / "kept.txt").exists()
    (tmp_path / "record").unlink()
    assert opened(launch_config(tmp_path, "run.overwrite=true")) is None
    assert [p.name for p in tmp_path.iterdir()] == [checkpoint.MARKER] and (outside / "kept.txt").exists()


def test_auto_starts_afresh_after_a_crash_before_the_first_checkpoint(tmp_path, capsys):
    """A kill during the first checkpoint write leaves config.yaml, metrics.jsonl and a .tmp save:
    run.resume=auto is a fresh run there ("a fresh run if there is none"), clearing only the run's files."""
    opened(launch_config(tmp_path))
    checkpoint.claim(tmp_path, "config.yaml").write_text("x")
    checkpoint.claim(tmp_path, "metrics.jsonl").write_text('{"step": 1}\n')
    checkpoint.begin(str(tmp_path), 2)
    assert opened(launch_config(tmp_path, "run.resume=auto")) is None
    assert [p.name for p in tmp_path.iterdir()] == [checkpoint.MARKER]
    assert "no complete checkpoint" in capsys.readouterr().err
    (tmp_path / "thesis.txt").write_text("x")  # not the run's file: refused as with overwrite
    with pytest.raises(ConfigError, match=r"thesis\.txt was not written by the run there"):
        opened(launch_config(tmp_path, "run.resume=auto"))
    (tmp_path / "thesis.txt").unlink()
    checkpoint.publish_final(tmp_path, write_final_files)  # a finished run without checkpoints is kept
    with pytest.raises(ConfigError, match=r"already holds a run"):
        opened(launch_config(tmp_path, "run.resume=auto"))
    assert checkpoint.is_final(tmp_path / "final")


def test_final_is_published_whole_or_not_at_all(tmp_path):
    checkpoint.publish_final(tmp_path, write_final_files)

    def dies_midway(folder):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        raise OSError("killed")

    with pytest.raises(OSError):
        checkpoint.publish_final(tmp_path, dies_midway)
    assert checkpoint.is_final(tmp_path / "final")  # the earlier final/ is intact
    assert not checkpoint.is_final(tmp_path / checkpoint.FINAL_TMP)
    checkpoint.publish_final(tmp_path, write_final_files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


@pytest.mark.parametrize("error, reason", [
    (OSError(28, "No space left on device", "/out/metrics.jsonl"), r"/out/metrics\.jsonl: No space left on device"),
    (OSError(13, "Permission denied", "/out/final"), r"/out/final: Permission denied"),
    (RuntimeError("learner pool: RayTaskError: ... OSError: [Errno 28] No space left on device"), r".*: No space left on device"),
])
def test_a_refused_write_names_what_and_where(tmp_path, error, reason):
    with pytest.raises(checkpoint.WriteFailed, match=r"could not write the run's files to " + reason):
        with checkpoint.writing("the run's files", tmp_path):
            raise error
    with pytest.raises(ValueError):  # not the disk's fault: the error passes unchanged
        with checkpoint.writing("the run's files", tmp_path):
            raise ValueError("a bug")


def test_a_full_disk_during_a_checkpoint_write_says_so(tmp_path):
    """A real full disk (a 1 MiB tmpfs): DCP's own error is 'unexpected pos 704 vs 598'."""
    import subprocess
    import torch.distributed.checkpoint as dcp
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        with pytest.raises(checkpoint.WriteFailed, match=r"checkpoint step_2 to .*disk/step_2.*full \(0 MiB free"):
            with checkpoint.writing("checkpoint step_2", disk / "step_2"):
                dcp.save({"w": torch.zeros(1 << 20)}, checkpoint_id=str(disk / "step_2"))
    finally:
        subprocess.run(["umount", str(disk)])
