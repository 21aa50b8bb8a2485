"""Two hosts for real: the Ray cluster path on two network namespaces of this machine (tests/netns_hosts.py).

A Ray head runs on one test host and offers the resource `learners`; a Ray worker node on the other offers
`generators`. The launcher, on the head, places the learner there and the generator and buffer on the
worker host (ray.*_resource). Every socket then binds on its own host's address (wire.host=auto), so the
generator reaches the learner's weights across the veth pair and the learner's controller the buffer, each
only with the run's CURVE keys. Then the worker host dies mid-run: the run stops within seconds naming the
role and the node, and `run.resume=auto` on the head finishes the job once the node is back.
Skips, saying why, where network namespaces cannot be made (not root).

Run alone: `python -m pytest tests/test_two_hosts.py -q` (~2 min).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from netns_hosts import FAST_NODE_DEATH, HostsUnavailable, TwoHosts

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ENV = {"PYTHONPATH": str(REPO)}
STEPS, SAVE_EVERY, STALENESS = 8, 2, 2
STOPS_WITHIN_S = 30  # from the worker host's death to the launcher's exit


@pytest.fixture(scope="module")
def hosts():
    try:
        made = TwoHosts.create()
    except HostsUnavailable as why:
        pytest.skip(str(why))
    try:
        yield made
    finally:
        made.destroy()


def test_a_socket_on_one_host_is_reached_from_the_other_only_with_the_runs_keys(hosts):
    server = hosts.popen(hosts.worker, [sys.executable, str(HERE / "netns_hosts.py"), "serve", hosts.worker.address],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)
    offer = json.loads(server.stdout.readline())
    assert offer["endpoint"].startswith(f"tcp://{hosts.worker.address}:")

    intruder = {**offer["keys"], **dict(zip(("client_public", "client_secret"), map(bytes.decode,
                                                                                    zmq.curve_keypair())))}
    probe = [sys.executable, str(HERE / "netns_hosts.py"), "lease", offer["endpoint"], "", json.dumps(intruder),
             json.dumps(offer["keys"])]
    plain, unkeyed, keyed = json.loads(hosts.run(hosts.head, probe, 60, **ENV).stdout)
    assert plain is None  # plain ZeroMQ from the other host: no handshake, no reply
    assert unkeyed is None  # knows the server's key, but not the run's client key
    assert len(keyed["leases"]) == 1  # the run's keys: leased across the veth pair
    server.stdin.close()
    assert json.loads(server.stdout.readline()) == 1  # the buffer saw exactly one lease: the keyed one
    server.wait(timeout=30)


def test_the_default_job_on_two_hosts_survives_losing_one_and_resumes(hosts, tmp_path):
    address = hosts.start_ray_head({"learners": 1}, **FAST_NODE_DEATH)
    hosts.start_ray_worker({"generators": 1})
    out = tmp_path / "run"
    launch = [sys.executable, "-m", "nanoverl_async.cli", "launch", "configs/agent_grpo.yaml", f"ray.address={address}",
              "ray.learner_resource=learners", "ray.generator_resource=generators", "ray.buffer_resource=generators",
              f"run.output_dir={out}", f"run.total_steps={STEPS}", f"run.save_every={SAVE_EVERY}",
              f"staleness.max={STALENESS}", "run.progress=false"]
    first = hosts.popen(hosts.head, launch, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        env=ENV)
    deadline = time.monotonic() + 300
    while not (out / "checkpoints" / f"step_{2 * SAVE_EVERY}").is_dir():  # two checkpoints: well under way
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
        time.sleep(0.2)

    hosts.kill_host(hosts.worker)  # the generator's and the buffer's machine is gone
    killed = time.monotonic()
    _, stderr = first.communicate(timeout=300)
    stopped_after = time.monotonic() - killed
    failure = stderr.strip().splitlines()[-1]
    print(f"the run stopped {stopped_after:.1f} s after the worker host died: {failure}")
    assert first.returncode == 1 and stopped_after < STOPS_WITHIN_S, (stopped_after, stderr[-3000:])
    assert "run failed" in failure and f"on node {hosts.worker.address}" in failure, failure
    assert "buffer" in failure or "generator 0" in failure, failure
    # where each role ran and each socket was bound: the buffer on the worker host, the weights on the head
    assert (f"placed: learner pool on {hosts.head.address}; buffer on {hosts.worker.address}; generator 0 on "
            f"{hosts.worker.address}. wire: buffer tcp://{hosts.worker.address}:") in stderr
    assert f"weights tcp://{hosts.head.address}:" in stderr and "(CURVE)" in stderr

    hosts.wait_until_dead(hosts.worker)
    hosts.start_ray_worker({"generators": 1})  # the machine is back; the head resumes the run
    resumed = hosts.run(hosts.head, [*launch, "run.resume=auto"], 600, **ENV)
    assert "resum" in resumed.stderr.lower() or (out / "final").is_dir()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))  # every step once: the lost ones re-run
    assert all(0 <= row["reward/mean"] <= 1 for row in rows)
    # versions flowed back from the head to the generator: no batch older than the staleness limit, so
    # by the last step the generator sampled with weights the learner published many steps in
    assert all(row["staleness/max"] <= STALENESS for row in rows)
    assert rows[-1]["learner/version"] == STEPS and (out / "final" / "config.json").is_file()
    last = out / "checkpoints" / f"step_{STEPS}"
    assert os.path.isfile(last / "buffer.msgpack")  # sent by the buffer, written by the controller on the head
    written_on = json.loads((last / "meta.json").read_text())["written_on"]
    assert written_on == {"learner": [hosts.head.address], "buffer and meta": hosts.head.address}
