"""Supervision: a role that dies ends the run within seconds naming it, never a hang; a hostile lease request
during a run is refused while the run goes on; Ray workers run the code of the checkout that launched; a
placement resource no node offers fails in one line (two real hosts: tests/test_two_hosts.py)."""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import ray
import zmq

import nanoverl_async
from nanoverl_async.config import ConfigError, RayConfig, load_config
from nanoverl_async.controller.preflight import prepare
from nanoverl_async.controller.roles import Roles, RunFailed, check_placement, role_failures
from nanoverl_async.models.tiny import TinyRecipe, build_model, build_tokenizer
from nanoverl_async.wire.auth import connect

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def random_tiny_model(tmp_path_factory):
    """An untrained builtin-architecture model: supervision does not need a good policy."""
    path = tmp_path_factory.mktemp("random_tiny")
    tokenizer = build_tokenizer()
    build_model(tokenizer, TinyRecipe(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                      intermediate_size=64)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def make_roles(model_path, tmp_path):
    cfg = load_config("configs/agent_grpo.yaml", [f"model.path={model_path}", f"run.output_dir={tmp_path}",
                                                 "data.prompts_per_step=2", "data.samples_per_prompt=2",
                                                 "run.step_timeout_s=60", "agent.hook_timeout_s=30",
                                                 "agent.rollout_timeout_s=50"])
    return Roles(prepare(cfg), model_path)  # as launch() does: roles get the prepared config


def kill_and_wait(actor, timeout_s: float = 30.0) -> None:
    """ray.kill is asynchronous: wait until the actor really is gone, so the test is not a race."""
    ray.kill(actor)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError("killed actor still answers")


def assert_a_dead_role_fails_the_run_naming_it(roles, victim: str, version: int) -> None:
    """Kill `victim` of a healthy run: the next step fails within seconds, naming it, never hangs."""
    actor = {"generator": roles.generators[0], "buffer": roles.buffer, "learner": roles.learners.ranks[0]}[victim]
    kill_and_wait(actor)
    started = time.monotonic()
    with pytest.raises(RunFailed, match={"generator": "generator 0", "buffer": "buffer", "learner": "learner"}[victim]):
        train_batch = roles.next_batch(version)
        with role_failures("learner pool"):
            roles.learners.update(roles.learners.prepare(train_batch.trajectories), version)
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("victim", ["generator", "buffer"])  # the learner: at the end of the hostile-lease test
def test_dead_role_fails_the_run_naming_it(ray_session, random_tiny_model, tmp_path, victim):
    roles = make_roles(random_tiny_model, tmp_path)
    try:
        batch = roles.next_batch(0)  # everything is up and streaming
        assert len(batch.trajectories) == 4
        assert_a_dead_role_fails_the_run_naming_it(roles, victim, version=1)
    finally:
        roles.shutdown()


def test_a_hostile_lease_request_during_a_run_is_refused_and_the_run_goes_on(ray_session, random_tiny_model,
                                                                             tmp_path):
    """A local process without the run's keys gets no reply at all (loopback is CURVE too). A peer holding
    them claims weights from the future and 400 groups (once it starved the generator until the gate timed
    out), and another claims a generator id the run does not have; both are refused and counted while the
    run's own generator keeps the batches coming. Then its learner dies: the dead-role test's third case, on
    this run instead of a run of its own (placing the roles takes ~10 s)."""
    roles = make_roles(random_tiny_model, tmp_path)
    context = zmq.Context()
    try:
        batch = roles.next_batch(0)  # the run is up and streaming
        endpoint = ray.get(roles.buffer.bound_endpoints.remote())["leases"]
        outsider = context.socket(zmq.DEALER)
        outsider.connect(endpoint)
        outsider.send(msgpack.packb({"op": "lease", "generator_id": 0, "version": 0, "max_groups": 1}))
        assert not outsider.poll(2_000)  # no keys, no handshake: its request never reaches the buffer
        dealer = context.socket(zmq.DEALER)
        connect(dealer, roles.curve)
        dealer.connect(endpoint)
        for claim in ({"generator_id": 0, "version": 10**6, "max_groups": 400},
                      {"generator_id": 5, "version": 0, "max_groups": 400}):
            dealer.send(msgpack.packb({"op": "lease", **claim}))
            assert dealer.poll(10_000)
            assert "error" in msgpack.unpackb(dealer.recv(), raw=False)
        for version in (1, 2):
            with role_failures("learner pool"):
                roles.learners.update(roles.learners.prepare(batch.trajectories), version - 1)
            roles.publish_weights(version=version)
            batch = roles.next_batch(version)
        stats = batch.stats
        assert stats["malformed_requests"] == 2 and set(stats["generator_versions"]) == {0}
        assert stats["staleness_max"] >= 0 and len(batch.trajectories) == 4
        assert_a_dead_role_fails_the_run_naming_it(roles, "learner", version=3)
    finally:
        context.destroy(linger=0)
        roles.shutdown()


ACTOR_CODE_SCRIPT = """
import ray, nanoverl_async
from nanoverl_async.config import RayConfig
from nanoverl_async.launcher import start_ray

start_ray(RayConfig())
where = ray.remote(num_cpus=0)(lambda: __import__("nanoverl_async").__file__)
print(nanoverl_async.__file__, ray.get(where.remote(), timeout=60))
ray.shutdown()
"""


def test_actors_run_the_code_of_the_checkout_that_launched(tmp_path):
    """A launch from another checkout (here a copy of the package) runs that copy in every Ray worker,
    not the copy installed in the environment."""
    shutil.copytree(Path(nanoverl_async.__file__).parent, tmp_path / "nanoverl_async",
                    ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run([sys.executable, "-c", ACTOR_CODE_SCRIPT], cwd=tmp_path, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    driver, actor = result.stdout.split()[-2:]
    assert driver == actor == str(tmp_path / "nanoverl_async" / "__init__.py")


def test_a_placement_resource_no_node_offers_fails_in_one_line(ray_session):
    check_placement(RayConfig())  # nothing named: any node
    with pytest.raises(ConfigError) as raised:
        check_placement(RayConfig(address="auto", generator_resource="generators"))
    message = str(raised.value)
    assert "'ray.generator_resource': no node of the Ray cluster offers the resource 'generators'" in message
    assert "ray start --resources='{\"generators\": 1}'" in message and "\n" not in message
