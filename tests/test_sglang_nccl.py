"""generator.sglang.weight_transport=nccl end to end: learner rank 0 loads weights into the SGLang servers
(learners/sglang_nccl.py) and the generators learn each version from an empty-state-dict notice.

Fast: the version notice crosses the weights wire; SGLangEngine.stage_weights takes notices (checks a server
holds the version, never writes weights); a dead server is not restarted under nccl; endpoints and the
handles rank 0 builds from them; make_engine accepts nccl; the config error for drain. Slow: the sender's
real process group (gloo) against a fake server process; the real CLI for 3 steps with two fake servers.

Run alone: `python -m pytest tests/test_sglang_nccl.py -q` (`-m "not slow"` for the fast tier).
"""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanoverl_async.config import ConfigError, GeneratorConfig, SGLangConfig, load_config
from nanoverl_async.agents.engine import SamplingParams
from nanoverl_async.generators.worker import make_engine
from nanoverl_async.generators.sglang_engine import SGLangEngine
from nanoverl_async.generators.sglang_server import SGLangServer
from nanoverl_async.wire.sglang_http import SGLangClient, SGLangError
from nanoverl_async.learners.sglang_nccl import SGLangWeightSender, check_reachable, server_handles
from nanoverl_async.wire.buckets import BucketSet
from nanoverl_async.wire.weights import WeightPublisher, WeightSubscriber
from sglang_helpers import PROMPT, assert_close, model_dirs, reference_logprobs, server, shared_server  # noqa: F401
from test_sglang_engine import FAKE, free_port, run_cli_on_fake_servers
from weight_waits import wait_newest

NCCL = SGLangConfig(weight_transport="nccl")


def test_version_notice_crosses_the_weights_wire():
    publisher = WeightPublisher()
    subscriber = WeightSubscriber(publisher.endpoint)
    try:
        # what rank 0 publishes after loading version 3 into the servers
        publisher.publish(3, BucketSet.of({}, 3, bucket_bytes=2**20))
        assert wait_newest(subscriber, 0, timeout_s=10) == (3, {})
    finally:
        subscriber.close()
        publisher.close()


def test_stage_weights_takes_version_notices(server, tmp_path):
    handle = SGLangServer(server.model_path, server.port, NCCL, url=server.url)
    engine = SGLangEngine(server.model_path, SGLangConfig(weight_transport="nccl", weights_dir=str(tmp_path)),
                          servers=[handle])
    server.weight_version = "2"  # rank 0 loaded version 2 (update_weights_from_distributed)
    engine.stage_weights({}, 2)
    assert engine.version == 2
    assert not any(tmp_path.iterdir()) and "/update_weights_from_disk" not in server.calls
    completion = asyncio.run(engine.generate(PROMPT, SamplingParams(3, 1.0)))
    assert completion.versions == [2, 2, 2]
    with pytest.raises(SGLangError, match="holds weights version '2'"):
        engine.stage_weights({}, 5)  # a notice ahead of the servers' weights
    with pytest.raises(ValueError, match="version notices"):
        engine.stage_weights({"w": torch.zeros(1)}, 3)
    assert engine.version == 2


def test_dead_server_is_not_restarted_under_nccl():
    port = free_port()  # nothing listens there: the request's connection fails
    handle = SGLangServer("unused", port, NCCL, command=[sys.executable, "-c", "pass"])
    handle.process = subprocess.Popen([sys.executable, "-c", "pass"])  # a server process that has exited
    handle.process.wait()
    engine = SGLangEngine("unused", NCCL, servers=[handle], start=False)
    try:
        with pytest.raises(SGLangError, match=rf"127.0.0.1:{port} died.*cannot rejoin.*weight_transport=disk"):
            asyncio.run(engine.generate(PROMPT, SamplingParams(2, 1.0)))
        assert handle.restarts == 0
    finally:
        handle.process = None


def test_endpoints_and_the_handles_rank_0_builds(server):
    two_gpus = SGLangConfig(tp_size=2)
    engine = SGLangEngine(server.model_path, two_gpus,
                          servers=[SGLangServer(server.model_path, server.port, two_gpus, url=server.url)])
    endpoints = engine.endpoints()
    assert endpoints == [{"url": server.url, "tp_size": 2, "server_version": "0.5.23", "legacy_protocol": False,
                          "node_ip": ""}]
    wildcard = SGLangServer("m", 9, SGLangConfig(), url="http://0.0.0.0:9")  # bound to every interface
    wildcard = SGLangEngine("m", SGLangConfig(), servers=[wildcard], start=False)
    assert wildcard.endpoints(node_ip="10.1.2.3")[0]["url"] == "http://10.1.2.3:9"
    (handle,) = server_handles(endpoints, SGLangConfig())
    assert (handle.url, handle.tp_size, handle.server_version) == (server.url, 2, "0.5.23")
    assert handle.legacy_protocol is False
    assert type(handle) is SGLangClient  # a client only: rank 0 never launches or restarts a server


def test_make_engine_accepts_nccl(monkeypatch):
    import nanoverl_async.generators.sglang_engine as sglang_engine

    made = []
    monkeypatch.setattr(sglang_engine, "SGLangEngine", lambda *args, **kw: made.append((args, kw)) or "engine")
    assert make_engine(GeneratorConfig(engine="sglang", sglang=NCCL), "m", generator_id=0, seed=0) == "engine"
    assert made[0][0][1].weight_transport == "nccl"


def test_nccl_needs_interrupt_mode():
    nccl = ["generator.engine=sglang", "generator.sglang.weight_transport=nccl"]
    with pytest.raises(ConfigError, match="config key 'weight_sync.mode'.*weight_transport=nccl"):
        load_config(None, [*nccl, "weight_sync.mode=drain"])
    assert load_config(None, [*nccl, "weight_sync.mode=interrupt"]).weight_sync.mode == "interrupt"


@pytest.mark.slow  # a fake server process (imports torch and transformers)
def test_sender_loads_a_fake_server_process_over_a_real_group(model_dirs, tmp_path):
    """The real path on a CPU: the fake joins rank 0's gloo group and receives the broadcast tensors."""
    from transformers import AutoModelForCausalLM

    events = tmp_path / "events.jsonl"
    cfg = SGLangConfig(launch_timeout_s=120, control_timeout_s=60, server_args=["--fake-events", str(events)])
    process = SGLangServer(model_dirs[0], free_port(), cfg, command=[sys.executable, FAKE])
    process.launch()
    process.wait_ready()
    try:
        servers = server_handles(SGLangEngine(model_dirs[0], cfg, servers=[process], start=False).endpoints(), cfg)
        sender = SGLangWeightSender(servers, "127.0.0.1", free_port(), bucket_bytes=40_000, timeout_s=60)
        sender.init_group(torch.device("cpu"))
        state = AutoModelForCausalLM.from_pretrained(model_dirs[1]).state_dict()
        sender.send(state.items(), version=1)
        sender.close()
        loaded = [json.loads(line) for line in events.read_text().splitlines()]
        assert {e["backend"] for e in loaded} == {"gloo"} and sum(e["tensors"] for e in loaded) == len(state)
        assert process.weight_version() == "1"
        completion = asyncio.run(SGLangEngine(model_dirs[0], cfg, servers=[process], start=False).generate(
            PROMPT, SamplingParams(6, 1.0)))
        assert completion.versions == [1] * 6
        assert_close(completion.logprobs, reference_logprobs(model_dirs[1], PROMPT, completion.token_ids))
    finally:
        process.close()


@pytest.mark.slow
def test_cli_runs_with_nccl_transport_on_fake_servers(ray_session, tmp_path):
    """The whole loop with weight_transport=nccl: learner rank 0 joins a gloo group with two fake server
    processes and loads each version into them; the generator learns versions from notices only."""
    events = tmp_path / "events.jsonl"
    rows = run_cli_on_fake_servers(tmp_path, "generator.sglang.weight_transport=nccl",
                                   "generator.sglang.control_timeout_s=120",
                                   f"generator.sglang.server_args=[--fake-events,{events}]")
    loaded = [json.loads(line) for line in events.read_text().splitlines()]
    assert {e["update"] for e in loaded} == {"distributed"} and {e["backend"] for e in loaded} == {"gloo"}
    for port in {e["port"] for e in loaded}:  # both servers received versions 1, 2, 3, in order
        assert [e["version"] for e in loaded if e["port"] == port][-3:] == ["1", "2", "3"]
    assert len({e["port"] for e in loaded}) == 2
    # Step 2 trains on tokens the servers sampled with version >= 1 (lag = 2 - version <= 1): the versions
    # come from the servers' replies, and the generator reported the notices' versions to the buffer.
    assert any(int(lag) <= 1 for lag in rows[2]["staleness/token_histogram"])
    assert rows[2]["weights/version_lag_max"] <= 1
    assert not (tmp_path / "w").exists() or not any((tmp_path / "w").rglob("model.safetensors"))


def test_loopback_servers_on_another_node_are_refused_before_joining():
    here = {"url": "http://127.0.0.1:30000", "node_ip": "10.0.0.1"}
    check_reachable([here, {"url": "http://10.0.0.2:30000", "node_ip": "10.0.0.2"}], rank0_ip="10.0.0.1")
    with pytest.raises(SGLangError, match=r"generator\.sglang\.host=0\.0\.0\.0"):
        check_reachable([here, {"url": "http://127.0.0.1:30001", "node_ip": "10.0.0.2"}], rank0_ip="10.0.0.1")


def test_roles_meet_only_through_the_wire():
    """Neither role imports the other: both reach the servers through nanoverl_async/wire/sglang_http.py,
    which imports nothing of either (nothing of the package at all)."""
    import ast

    package = Path(__file__).resolve().parents[1] / "nanoverl_async"
    for role, other in (("learners", "generators"), ("generators", "learners")):
        for path in (package / role).glob("*.py"):
            nodes = list(ast.walk(ast.parse(path.read_text())))
            names = [n.module or "" for n in nodes if isinstance(n, ast.ImportFrom)]
            names += [a.name for n in nodes if isinstance(n, ast.Import) for a in n.names]
            assert not [n for n in names if n.startswith(f"nanoverl_async.{other}")], f"{path.name} imports {other}"
    client = ast.parse((package / "wire" / "sglang_http.py").read_text())
    assert not [n.module for n in ast.walk(client) if isinstance(n, ast.ImportFrom) and
                (n.module or "").startswith("nanoverl_async.")]
