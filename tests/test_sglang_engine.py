"""SGLangEngine and SGLangWeightSender against fake SGLang servers (tests/fake_sglang_server.py).

Covers: completions with real logprobs; a weight update during generation in abort mode (the aborted
request is resumed from its partial tokens, versions per token switch once) and in retract mode (one
request, two version spans); client-side version tagging on servers without spans; least-outstanding
routing with sticky episodes; a server process that dies mid-request is restarted with the newest
weights and the request completes; a call past its timeout fails loudly; NCCL-protocol updates (both
protocol variants, tensors through the fake's broadcast queue). Slow tier: a dead server process is
restarted; the sender's custom process group broadcasts (gloo, two processes); the real CLI runs 3 steps
with generator.engine=sglang on two fake server processes. `test_real_sglang_server` drives a real
SGLang server and runs only where sglang imports and a GPU is present. weight_transport=nccl end to end:
tests/test_sglang_nccl.py.

Run alone: `python -m pytest tests/test_sglang_engine.py -q`.
"""

import asyncio
import importlib.util
import os
import random
import socket
import sys
import threading
from pathlib import Path

import pytest
import torch

from fake_sglang_server import FakeSGLangServer
from nanoverl_async.config import GeneratorConfig, SGLangConfig
from nanoverl_async.agents.engine import SamplingParams
from nanoverl_async.generators.worker import make_engine
from nanoverl_async.generators.sglang_engine import SGLangEngine, write_hf_dir
from nanoverl_async.generators.sglang_server import SGLangServer
from nanoverl_async.wire.sglang_http import SGLangError
from nanoverl_async.learners.sglang_nccl import SGLangWeightSender, buckets, server_handles
from sglang_helpers import (PROMPT, assert_close, model_dirs, reference_logprobs, server,  # noqa: F401
                            shared_server)
from test_cli_run import launch_in_process, read_metrics

FAKE = str(Path(__file__).with_name("fake_sglang_server.py"))


def engine_on(fakes, **cfg) -> SGLangEngine:
    config = SGLangConfig(**cfg)
    servers = [SGLangServer(f.model_path, f.port, config, url=f.url) for f in fakes]
    return SGLangEngine(fakes[0].model_path, config, servers=servers)


def check_per_version(completion, model_dirs, prompt=PROMPT):
    """Each token's logprob is that of the weights its version names, given the whole context."""
    for version, model_dir in enumerate(model_dirs):
        want = reference_logprobs(model_dir, prompt, completion.token_ids)
        got = [(g, w) for g, w, v in zip(completion.logprobs, want, completion.versions) if v == version]
        assert_close([g for g, _ in got], [w for _, w in got])


async def generate_while(engine, action, tokens: int, wait_for: int, fake):
    """Start one request, run `action` (blocking, on a thread) once it has `wait_for` tokens."""
    task = asyncio.create_task(engine.generate(PROMPT, SamplingParams(tokens, 1.0)))
    while not any(len(r.out) >= wait_for for r in list(fake.requests.values())):
        await asyncio.sleep(0.005)
    await asyncio.to_thread(action)
    return await task


def test_completion_has_real_logprobs(server, model_dirs):
    engine = engine_on([server])
    completion = asyncio.run(engine.generate(PROMPT, SamplingParams(8, 0.7, (3,))))
    assert completion.finish_reason in ("stop", "length") and completion.versions == [0] * len(completion.token_ids)
    assert_close(completion.logprobs, reference_logprobs(model_dirs[0], PROMPT, completion.token_ids, 0.7))


@pytest.mark.parametrize("pause_mode", ["abort", "retract"])
def test_weight_update_during_generation(server, model_dirs, tmp_path, pause_mode):
    server.token_delay_s = 0.02  # the 57 tokens after the third take >= 1 s: the update comes first
    engine = engine_on([server], pause_mode=pause_mode, weights_dir=str(tmp_path))
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(model_dirs[1]).state_dict()
    completion = asyncio.run(generate_while(engine, lambda: engine.stage_weights(state, 1), 60, 3, server))
    assert len(completion.token_ids) == 60 and completion.finish_reason == "length"
    split = completion.versions.index(1)
    assert split >= 3 and completion.versions == [0] * split + [1] * (60 - split)
    assert server.calls.count("/generate") == (2 if pause_mode == "abort" else 1) and engine.version == 1  # resumed
    check_per_version(completion, model_dirs)
    assert server.calls.count("/pause_generation") == 1 and server.calls[-1] != "/pause_generation"


def test_a_version_in_buckets_is_written_as_shards_and_loaded_only_once_whole(server, model_dirs, tmp_path):
    """Transport disk, a bucket at a time (wire/buckets.py): one shard per bucket, the servers told only after
    the last; a version abandoned part-written (a bucket lost on the way) is removed when the next one starts."""
    from transformers import AutoModelForCausalLM

    from nanoverl_async.wire.buckets import plan

    engine = engine_on([server], weights_dir=str(tmp_path))
    state = AutoModelForCausalLM.from_pretrained(model_dirs[1]).state_dict()
    buckets = plan({name: (t.dtype, tuple(t.shape)) for name, t in state.items()}, 64 * 1024)
    assert len(buckets) > 2
    engine.stage_weights({name: state[name] for name in buckets[0]}, 1, (0, len(buckets)))  # version 1: bucket 0
    held, loads = 0, 0
    for version in (2, 3):
        for index, names in enumerate(buckets):  # the servers keep the version held until the last bucket is in
            assert engine.version == held and server.calls.count("/update_weights_from_disk") == loads
            engine.stage_weights({name: state[name] for name in names}, version, (index, len(buckets)))
        held, loads = version, loads + 1
        assert engine.version == version
    assert sorted(path.name for path in tmp_path.glob("generator_0/v*")) == ["v3"]
    assert len(list((tmp_path / "generator_0" / "v3").glob("model-*-of-*.safetensors"))) == len(buckets)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "generator_0" / "v3").state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert server.calls.count("/update_weights_from_disk") == 2  # versions 2 and 3, each once whole


def test_client_side_versions_without_spans(model_dirs, tmp_path):
    fake = FakeSGLangServer(model_dirs[0], weight_version="0", fake_version="0.5.10").start()
    try:
        fake.token_delay_s = 0.02
        engine = engine_on([fake], weights_dir=str(tmp_path))
        completion = asyncio.run(generate_while(
            engine, lambda: engine.update_from_disk(model_dirs[1], 1), 60, 3, fake))
        split = completion.versions.index(1)  # tagged per aborted segment from meta_info.weight_version
        assert completion.versions == [0] * split + [1] * (60 - split)
        check_per_version(completion, model_dirs)
    finally:
        fake.stop()


def test_routing_least_outstanding_and_sticky_episodes(model_dirs):
    fakes = [FakeSGLangServer(model_dirs[0]).start() for _ in range(2)]
    try:
        engine = engine_on(fakes)
        engine.outstanding = [3, 1]
        assert engine.route(None) == 1 and engine.route("ep") == 1 and engine.in_flight() == 4
        engine.outstanding = [0, 5]
        assert engine.route("ep") == 1 and engine.route("other") == 0  # the episode stays on its server

        async def episodes():
            return await asyncio.gather(*(engine.generate(PROMPT, SamplingParams(4, 1.0), episode_id=f"e{i}")
                                          for i in range(6)))
        engine.outstanding = [0, 0]
        asyncio.run(episodes())
        assert engine.in_flight() == 0
        assert sum(f.calls.count("/generate") for f in fakes) == 6 and all(f.calls.count("/generate") for f in fakes)
    finally:
        for fake in fakes:
            fake.stop()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def free_port_base(count: int) -> int:
    """A base with `count` consecutive free ports, below Linux's ephemeral range (32768+), where an
    outgoing connection (Ray opens many) could take port base + 1 between this check and the launch."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20_000, 32_000)
        try:
            for port in range(base, base + count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports in 20000-32000")


@pytest.mark.slow  # two server processes start (imports of torch and transformers): ~10 s
def test_dead_server_is_restarted_and_requests_reissued(model_dirs, tmp_path):
    cfg = SGLangConfig(launch_timeout_s=120, request_timeout_s=60, weights_dir=str(tmp_path),
                       server_args=["--fake-token-delay-s", "0.01"])  # 100 tokens take >= 1 s
    server = SGLangServer(model_dirs[0], free_port(), cfg, command=[sys.executable, FAKE])
    engine = SGLangEngine(model_dirs[0], cfg, servers=[server])
    try:
        engine.update_from_disk(model_dirs[1], 1)  # a restart must come back with these weights

        async def run():
            task = asyncio.create_task(engine.generate(PROMPT, SamplingParams(100, 1.0)))
            await asyncio.sleep(0.3)
            server.process.kill()  # dies with the request in flight
            return await task

        completion = asyncio.run(run())
        assert server.restarts == 1 and len(completion.token_ids) == 100
        assert server.weight_version() == "1" and set(completion.versions) == {1}
        assert "--model-path" in server.launch_args() and model_dirs[1] in server.launch_args()
    finally:
        engine.close()


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_a_missing_sglang_extra_is_named_before_any_launch():
    with pytest.raises(SGLangError, match=r"generator.engine=sglang needs `pip install -e '\.\[sglang\]'`"):
        SGLangEngine("unused", SGLangConfig())


def test_a_call_past_its_timeout_fails_loudly():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # accepts connections, never answers
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        cfg = SGLangConfig(request_timeout_s=0.5, control_timeout_s=0.5)
        engine = SGLangEngine("unused", cfg, servers=[SGLangServer("unused", 0, cfg, url=url)], start=False)
        with pytest.raises(SGLangError, match="no reply within"):
            asyncio.run(engine.generate(PROMPT, SamplingParams(2, 1.0)))
        with pytest.raises(SGLangError, match="no reply within"):
            engine.servers[0].pause("abort")
    finally:
        silent.close()


@pytest.mark.parametrize("fake_version", ["0.5.23", "0.5.10"])
def test_nccl_sender_both_protocols(model_dirs, fake_version):
    fakes = [FakeSGLangServer(model_dirs[0], weight_version="0", fake_version=fake_version).start() for _ in range(2)]
    try:
        servers = [SGLangServer(f.model_path, f.port, SGLangConfig(), url=f.url) for f in fakes]
        engine = SGLangEngine(model_dirs[0], SGLangConfig(), servers=servers)  # waits until each is ready
        clients = server_handles(engine.endpoints(), SGLangConfig())  # what rank 0 holds: clients, not servers
        sender = SGLangWeightSender(clients, "127.0.0.1", 29600, bucket_bytes=40_000,
                                    broadcast=lambda t: [f.nccl.put(t.clone()) for f in fakes])
        sender.init_group()
        from transformers import AutoModelForCausalLM

        state = AutoModelForCausalLM.from_pretrained(model_dirs[1]).state_dict()
        state.pop("lm_head.weight")  # tied to the embeddings
        sender.send(state.items(), version=1)
        for fake in fakes:
            begins = fake.calls.count("/begin_weight_update")
            assert begins == (1 if fake_version == "0.5.23" else 0)
            assert fake.calls.count("/update_weights_from_distributed") == len(buckets(list(state.items()), 40_000)) > 1
            assert fake.weight_version == "1" and fake.paused is None
        completion = asyncio.run(engine.generate(PROMPT, SamplingParams(6, 1.0)))
        assert completion.versions == [1] * 6
        assert_close(completion.logprobs, reference_logprobs(model_dirs[1], PROMPT, completion.token_ids))
        sender.close()
    finally:
        for fake in fakes:
            fake.stop()


def test_written_weights_load_and_factory_choices(model_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(model_dirs[1]).state_dict()
    path = write_hf_dir(state, model_dirs[1], tmp_path / "v1")
    loaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert make_engine(GeneratorConfig(), model_dirs[0], generator_id=0, seed=0).version == 0


def sglang_and_gpu() -> bool:
    try:
        import sglang  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not sglang_and_gpu(), reason="needs sglang and a GPU")
def test_real_sglang_server(tmp_path):
    """A real server on a small model: generate with versions, a disk update, resume after abort."""
    model = os.environ.get("NANOVERL_SGLANG_TEST_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")
    cfg = SGLangConfig(port_base=free_port(), mem_fraction_static=0.3, weights_dir=str(tmp_path))
    engine = SGLangEngine(model, cfg, dtype="bfloat16")
    try:
        completion = asyncio.run(engine.generate([151644, 872, 198], SamplingParams(32, 1.0)))
        assert len(completion.token_ids) == len(completion.logprobs) == len(completion.versions) > 0
        done = threading.Event()

        async def run():
            task = asyncio.create_task(engine.generate([151644, 872, 198], SamplingParams(512, 1.0)))
            await asyncio.sleep(0.5)
            await asyncio.to_thread(engine.update_from_disk, model, 1)
            done.set()
            return await task

        completion = asyncio.run(run())
        assert done.is_set() and completion.versions[-1] == 1 and completion.versions[0] == 0
    finally:
        engine.close()


def run_cli_on_fake_servers(tmp_path, *overrides: str) -> list[dict]:
    """The CLI's launch (in this process, on the ray_session instance) for 3 steps with generator.engine=sglang
    on two fake server processes; metrics rows."""
    assert launch_in_process(tmp_path, "run.total_steps=3", "staleness.max=1", "data.prompts_per_step=4",
                             "generator.engine=sglang", "generator.sglang.servers=2",
                             f"generator.sglang.port_base={free_port_base(2)}",
                             f"generator.sglang.weights_dir={tmp_path / 'w'}",
                             f"generator.sglang.server_command=[{sys.executable},{FAKE}]", *overrides) == 0
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == [1, 2, 3]
    return rows


@pytest.mark.slow
def test_cli_runs_with_sglang_engine_on_fake_servers(ray_session, tmp_path):
    """The whole loop with generator.engine=sglang: the worker launches two fake server processes, routes
    episodes over them, and loads each new version with update_weights_from_disk between pause/continue."""
    rows = run_cli_on_fake_servers(tmp_path)
    assert all(row["staleness/max"] <= row["staleness/limit"] for row in rows)
    assert sorted(p.name for p in (tmp_path / "w" / "generator_0").iterdir())[-1].startswith("v")


@pytest.mark.slow  # a second process (imports torch)
def test_custom_process_group_broadcasts_from_rank_0():
    """The group the NCCL sender builds, with gloo: rank 0 here, rank 1 (a server's place) in a subprocess."""
    import subprocess

    from nanoverl_async.learners.sglang_nccl import init_custom_process_group

    port = free_port()
    receiver = ("import torch; from nanoverl_async.learners.sglang_nccl import init_custom_process_group as g; "
                f"pg = g('gloo', 'tcp://127.0.0.1:{port}', 2, 1, 'weight_update_group', 60); t = torch.zeros(3); "
                "torch.distributed.broadcast(t, src=0, group=pg); print(t.tolist())")
    child = subprocess.Popen([sys.executable, "-c", receiver], stdout=subprocess.PIPE, text=True)
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "weight_update_group", 60)
    try:
        torch.distributed.broadcast(torch.tensor([1.0, 2.0, 3.0]), src=0, group=group)
        out, _ = child.communicate(timeout=60)
        assert out.strip() == "[1.0, 2.0, 3.0]"
    finally:
        torch.distributed.destroy_process_group(group)
        child.kill()
