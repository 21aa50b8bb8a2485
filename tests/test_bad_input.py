"""The bad-input corpus: configs, datasets, checkpoints, user hooks and wire messages a careless user,
a faulty generator or a hostile peer could produce. Each case either stops the launch with ONE line
naming the culprit (the key, file, row, hook or field) before anything starts, or is counted and
ignored by the running buffer service while a good batch still arrives. Nothing here starts Ray.

Run alone: `python -m pytest tests/test_bad_input.py -q` (~30 s).
"""

import asyncio
import json

import msgpack
import numpy as np
import pytest
import zmq

from nanoverl_async import multiply_task
from nanoverl_async.buffer.service import BufferService
from nanoverl_async.config import AgentConfig, BufferConfig, ConfigError, GeneratorConfig, load_config
from nanoverl_async.generators.agent_loop import run_episode
from nanoverl_async.launcher import launch
from nanoverl_async.trajectory import encode
from nanoverl_async.user_code import UserCodeError, load_object
from test_agent_loop import ScriptedEngine
from test_buffer_service import VOCAB, make_trajectory

ONE_LINE_TIMEOUT_S = 60

# --- configs: each override alone, on the default config -> (override, what the one line must name)
CONFIG_CASES = [
    ("learner.lr=inf", "'learner.lr': must be a finite number"),
    ("learner.lr=nan", "'learner.lr': must be a finite number"),
    ("generator.temperature=-1", "'generator.temperature'"),
    ("run.seed=1180591620717411303424", "'run.seed'"),  # 2**70
    ("run.seed=-3", "'run.seed'"),
    ("buffer.lease_timeout_s=0.001", "'buffer.lease_timeout_s': must be >= 1"),
    ("staleness.max=-1", "'staleness.max'"),
    ("data.samples_per_prompt=0", "'data.samples_per_prompt'"),
    ("algorithm.advantage=ppo2", "'algorithm.advantage'"),
    ("algorithm.clip.low=1.5", "'algorithm.clip.low'"),
    ("learner.betas=[0.9]", "'learner.betas'"),
    ("agent.max_new_tokens=500", "'agent.max_new_tokens'"),
    ("learner.world_size=3", "'learner.world_size'"),
    ("no.such_key=1", "'no.such_key'"),
    ("learner.lr=fast", "'learner.lr'"),
    ("model.path=", "'model.path'"),
    ("run.eval_every=2", "'run.eval_every': needs data.val_files"),
    ("kl.reward_coef=0.1", "'kl.reward_coef'"),
    ("run.deterministic=true", "'run.deterministic': needs staleness.max=0"),  # the default job is async
    ("ray.learner_resource=learners", "'ray.learner_resource': places roles on a cluster's nodes, so it needs"),
]
# --- the world the config names, checked at launch before Ray starts
LAUNCH_CASES = [
    ("model.path=builtin:huge", "'model.path': 'builtin:huge' is not a built-in model; the built-in models are"),
    ("model.path=/nonexistent/model", "'model.path': '/nonexistent/model' is not a directory"),
    ("wire.host=203.0.113.7", "'wire.host': cannot bind '203.0.113.7'"),
    ("wire.host=not a host", "'wire.host'"),
    ("agent.env=nanoverl_async.env:Nope", "'agent.env'"),
    ("agent.env=builtin:nope", "'agent.env'"),
    ("data.task=builtin:nope", "'data.task'"),
    ("reward.path=/nonexistent/reward.py", "'reward.path'"),
    ("data.train_files=/nonexistent/train.parquet", "'data.train_files': file '/nonexistent/train.parquet' does not"),
    ("data.train_files=notes.txt", "'data.train_files': 'notes.txt' is not a .parquet or .jsonl file"),
    ("run.resume=/nonexistent/step_3", "'run.resume'"),
]


def assert_one_line(error: Exception, culprit: str) -> None:
    message = str(error)
    assert culprit in message, message
    assert "\n" not in message.strip() and "Traceback" not in message, message


@pytest.mark.parametrize("override,culprit", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_values_fail_in_one_line(override, culprit):
    with pytest.raises(ConfigError) as raised:
        load_config("configs/agent_grpo.yaml", [override])
    assert_one_line(raised.value, culprit)


@pytest.mark.parametrize("override,culprit", LAUNCH_CASES, ids=[c[0] for c in LAUNCH_CASES])
def test_what_the_config_points_at_is_checked_before_anything_starts(tmp_path, override, culprit):
    cfg = load_config("configs/agent_grpo.yaml", [override, f"run.output_dir={tmp_path}/out"])
    with pytest.raises(ConfigError) as raised:
        launch(cfg)
    assert_one_line(raised.value, culprit)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


# --- datasets: file contents -> the culprit (file, row or line, column)
DATASET_CASES = [
    ('{"question": "2+2?"}\n', "row 0: no 'prompt' column (the row has 'question')"),
    ('{"prompt": "What is 2+2?"}\n', "row 0: column 'prompt' must be a list"),
    ('{"prompt": [{"content": "no role"}]}\n', "row 0: column 'prompt' must be a list"),
    ('{"prompt": [{"role": "user", "content": "ok"}]}\n{"prompt": [\n', "line 2: not JSON"),
    ('[1, 2, 3]\n', "row 0: a row must be a JSON object"),
    ('{"prompt": "[not json"}\n', "row 0: column 'prompt' must be a list"),
    ("", "no rows in"),
]


@pytest.mark.parametrize("contents,culprit", DATASET_CASES, ids=[f"dataset-{i}" for i in range(len(DATASET_CASES))])
def test_bad_datasets_fail_at_launch_naming_file_and_row(tmp_path, contents, culprit):
    (tmp_path / "train.jsonl").write_text(contents)
    cfg = load_config("configs/agent_grpo.yaml", [f"data.train_files={tmp_path}/train.jsonl",
                                                  f"run.output_dir={tmp_path}/out"])
    with pytest.raises(ConfigError) as raised:
        launch(cfg)
    assert_one_line(raised.value, culprit)
    assert "'data.train_files'" in str(raised.value) and "train.jsonl" in str(raised.value)


# --- checkpoints: a damaged step_N folder -> one line naming the file
def write_checkpoint(root, meta_text: str, files=("learner/.metadata", "buffer.msgpack")):
    folder = root / "checkpoints" / "step_3"
    (folder / "learner").mkdir(parents=True)
    (folder / "meta.json").write_text(meta_text)
    for name in files:
        (folder / name).write_bytes(b"x")
    return folder


@pytest.mark.parametrize("case", ["truncated-meta", "meta-without-step", "no-learner-metadata", "no-buffer-state"])
def test_a_damaged_checkpoint_is_one_line_naming_the_file(tmp_path, case):
    from nanoverl_async.checkpoint import trained_config

    out = tmp_path / "out"
    cfg = load_config("configs/agent_grpo.yaml", [f"run.output_dir={out}", "run.resume=auto"])
    good = json.dumps({"step": 3, "seed": 0, "config": trained_config(cfg)})
    meta, files, culprit = {
        "truncated-meta": (good[:40], ("learner/.metadata", "buffer.msgpack"), "meta.json is unreadable"),
        "meta-without-step": ('{"seed": 0}', ("learner/.metadata", "buffer.msgpack"), "meta.json is unreadable"),
        "no-learner-metadata": (good, ("buffer.msgpack",), "learner/.metadata is missing"),
        "no-buffer-state": (good, ("learner/.metadata",), "buffer.msgpack is missing"),
    }[case]
    write_checkpoint(out, meta, files)
    with pytest.raises(ConfigError) as raised:
        launch(cfg)
    assert_one_line(raised.value, culprit)
    assert "'run.resume'" in str(raised.value)


# --- user hooks: a bug in the user's environment -> one line naming the hook and the user's file:line
USER_ENVS = '''
from nanoverl_async import Environment, Step


class StepRaises(Environment):
    async def step(self, sample, message):
        return Step(reward=sample["answr"])


class ResetRaises(Environment):
    def reset(self, sample):
        raise RuntimeError("no prompt for you")


class StepReturnsFloat(Environment):
    async def step(self, sample, message):
        return 1.0


class StepReturnsNone(Environment):
    async def step(self, sample, message):
        pass


class RolloutReturnsText:
    async def rollout(self, episode, sample):
        episode.start(sample["messages"])
        return "1.0"


class RolloutRaises:
    async def rollout(self, episode, sample):
        return 1 / 0
'''
HOOK_CASES = [
    ("StepRaises", "agent.env step() raised KeyError: 'answr' at user_envs.py:7 in step"),
    ("ResetRaises", "agent.env reset() raised RuntimeError: no prompt for you at user_envs.py:12 in reset"),
    ("StepReturnsFloat", "agent.env step() returned float 1.0; return a nanoverl_async.env.Step"),
    ("StepReturnsNone", "agent.env step() returned NoneType None; return a nanoverl_async.env.Step"),
    ("RolloutReturnsText", "agent.env rollout() returned str '1.0'; return the episode's reward as a float"),
    ("RolloutRaises", "agent.env rollout() raised ZeroDivisionError: division by zero at user_envs.py:33 in rollout"),
]


@pytest.mark.parametrize("name,culprit", HOOK_CASES, ids=[c[0] for c in HOOK_CASES])
def test_user_hook_errors_name_the_hook_and_the_line(tmp_path, name, culprit):
    from nanoverl_async.tiny_model import build_tokenizer

    (tmp_path / "user_envs.py").write_text(USER_ENVS)
    tokenizer = build_tokenizer()
    env = load_object(f"{tmp_path}/user_envs.py:{name}")()
    sample = multiply_task.make_prompt(0, 1)
    with pytest.raises(UserCodeError) as raised:
        asyncio.run(run_episode(ScriptedEngine(tokenizer, ["7<|end|>"]), tokenizer, sample, env,
                                AgentConfig(max_turns=2, max_new_tokens=8, max_total_tokens=64), 1.0))
    assert_one_line(raised.value, culprit)


# --- the wire: what a faulty generator or a hostile peer sends -> counted and ignored; the run goes on
def forged(lease, **changes) -> bytes:
    t = make_trajectory(lease, 0, [0, 0])
    for name, value in changes.items():
        setattr(t, name, value)
    return encode(t)


def raw_record(lease, **fields) -> bytes:
    record = msgpack.unpackb(encode(make_trajectory(lease, 0, [0, 0])), raw=False)
    record.update(fields)
    return msgpack.packb(record, use_bin_type=True)


TRAJECTORY_CASES = {  # name -> lease -> message bytes; every one is malformed, a duplicate or a straggler
    "not-msgpack": lambda lease: b"\xc1\xc1",
    "a-list": lambda lease: msgpack.packb([1, 2, 3]),
    "unknown-field": lambda lease: raw_record(lease, extra=1),
    "reward-is-text": lambda lease: raw_record(lease, reward="1.0"),
    "reward-inf": lambda lease: forged(lease, reward=float("inf")),
    "ids-beyond-vocab": lambda lease: forged(lease, token_ids=np.full(5, 5000, dtype=np.int32)),
    "negative-id": lambda lease: forged(lease, token_ids=np.array([0, 1, -2, 3, 4], dtype=np.int32)),
    "version-from-the-future": lambda lease: forged(lease, versions=np.array([-1, -1, 0, 1000, -1], np.int32)),
    "versions-backwards": lambda lease: encode(make_trajectory(lease, 0, [1, 0])),
    "call-outside-its-episode": lambda lease: forged(lease, spans=[["episode", 5.0, 6.0], ["tool", 4.0, 5.5]]),
    "logprob-positive": lambda lease: forged(lease, behaviour_logprobs=np.array([0, 0, 2.0, -1, 0], np.float32)),
    "logprob-nan": lambda lease: forged(lease, behaviour_logprobs=np.array([0, 0, np.nan, -1, 0], np.float32)),
    "mask-not-binary": lambda lease: forged(lease, loss_mask=np.array([0, 0, 2, 1, 0], np.uint8)),
    "length-mismatch": lambda lease: forged(lease, loss_mask=np.array([0, 0, 1], np.uint8)),
    "empty": lambda lease: forged(lease, token_ids=np.zeros(0, np.int32), loss_mask=np.zeros(0, np.uint8),
                                  behaviour_logprobs=np.zeros(0, np.float32), versions=np.zeros(0, np.int32)),
}
REQUEST_CASES = [  # requests refused with an error naming the field, counted
    (b"\xc1", "msgpack"),
    ({"op": "steal", "generator_id": 0, "version": 0}, "'op'"),
    ({"op": "lease", "generator_id": 0, "version": 0}, "'max_groups'"),
    ({"op": "lease", "generator_id": 0, "version": 10**6, "max_groups": 400}, "'version': 1000000 was never published"),
    ({"op": "lease", "generator_id": 9, "version": 0, "max_groups": 1}, "'generator_id': 9 is not one of"),
    ({"op": "report", "generator_id": 0, "version": 7}, "'version': 7 was never published"),
    ({"op": "report", "generator_id": -1, "version": 0}, "'generator_id'"),
]


def test_the_buffer_counts_and_ignores_every_bad_message_and_still_hands_out_a_batch():
    service = BufferService(1, 2, 0, BufferConfig(lease_timeout_s=30), "127.0.0.1",
                            GeneratorConfig(replicas=1, max_groups_in_flight=4), VOCAB,
                            lambda index: {"index": index})
    context = zmq.Context()
    push, dealer = context.socket(zmq.PUSH), context.socket(zmq.DEALER)
    push.connect(service.endpoints["trajectories"])
    dealer.connect(service.endpoints["leases"])

    def ask(request):
        dealer.send(request if isinstance(request, bytes) else msgpack.packb(request))
        assert dealer.poll(5000), "no reply"
        return msgpack.unpackb(dealer.recv(), raw=False)

    try:
        for request, culprit in REQUEST_CASES:
            assert culprit in ask(request)["error"]
        (lease,) = ask({"op": "lease", "generator_id": 0, "version": 0, "max_groups": 1})["leases"]
        for make in TRAJECTORY_CASES.values():
            push.send(make(lease))
        first = make_trajectory(lease, 0, [0, 0])
        push.send(encode(first))
        push.send(encode(first))  # an exact resend
        copy = make_trajectory(lease, 1, [0, 0])
        copy.id = first.id  # the same episode posing as the second sample
        push.send(encode(copy))
        push.send(encode(make_trajectory({"group_id": 99, "prompt_index": 0}, 1, [0])))  # no such lease
        push.send(encode(make_trajectory(lease, 1, [0, 0])))  # the real second sample completes the group
        batch = service.next_batch(step=0, timeout_s=ONE_LINE_TIMEOUT_S)
        stats = batch.stats
        assert stats["malformed"] == len(TRAJECTORY_CASES) and stats["malformed_requests"] == len(REQUEST_CASES)
        assert stats["dropped_duplicates"] == 2 and stats["dropped_stragglers"] == 1
        assert [t.sample_index for t in batch.trajectories] == [0, 1] and stats["generator_versions"] == {0: 0}
    finally:
        context.destroy(linger=0)
        service.close()

