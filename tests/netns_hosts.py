"""Two test hosts on this one machine: Linux network namespaces joined by a veth pair, each with its own
address, a Ray head node in one and a Ray worker node in the other. Never a real network.

    hosts = TwoHosts.create()            # needs root (ip netns); raises HostsUnavailable otherwise
    hosts.start_ray_head(resources); hosts.start_ray_worker(resources)
    hosts.popen(hosts.head, [...])       # a process on a host: it sees that host's address only
    hosts.kill_host(hosts.worker)        # SIGKILL every process of a host (a machine that died)
    hosts.wait_until_dead(hosts.worker)  # until the head has declared its node dead
    hosts.destroy()

Run as a script it is the wire probe of tests/test_two_hosts.py, one end per host:
    python netns_hosts.py serve HOST     # a BufferService bound on HOST with fresh run keys; prints them
    python netns_hosts.py lease ENDPOINT KEYS_JSON...  # one lease request per KEYS_JSON ("": plain)
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.213.77"  # the test hosts' own /24 on the veth pair; nothing outside the namespaces sees it
RAY_PORT = 6379
# every node and the launcher share one token, as docs/gpus.md has a real cluster do
RAY_ENV = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0"}
# the head declares a silent node dead after ~3 s instead of Ray's default ~15-30 s (the test waits for it)
FAST_NODE_DEATH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                   "RAY_health_check_failure_threshold": "3"}
RAY = str(Path(sys.executable).parent / "ray")


class HostsUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, no `ip`): the tests skip, saying why."""


@dataclass
class Host:
    namespace: str
    address: str
    temp_dir: str = ""  # Ray's, one per node (sockets live there)


@dataclass
class TwoHosts:
    head: Host
    worker: Host
    processes: list = field(default_factory=list)

    @classmethod
    def create(cls) -> "TwoHosts":
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise HostsUnavailable("network namespaces need root and iproute2's `ip`")
        tag = os.getpid() % 100_000
        hosts = cls(Host(f"nvh{tag}", f"{SUBNET}.1"), Host(f"nvw{tag}", f"{SUBNET}.2"))
        veth = (f"nvh{tag}v", f"nvw{tag}v")
        try:
            for host in (hosts.head, hosts.worker):
                _ip("netns", "add", host.namespace)
                _ip("-n", host.namespace, "link", "set", "lo", "up")
            _ip("link", "add", veth[0], "netns", hosts.head.namespace, "type", "veth", "peer", "name", veth[1],
                "netns", hosts.worker.namespace)
            for host, device in zip((hosts.head, hosts.worker), veth):
                _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", device)
                _ip("-n", host.namespace, "link", "set", device, "up")
        except subprocess.CalledProcessError as error:
            hosts.destroy()
            raise HostsUnavailable(f"cannot create network namespaces: {error.stderr.strip()}") from None
        return hosts

    def command(self, host: Host, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", host.namespace, *argv]

    def popen(self, host: Host, argv: list[str], **kwargs) -> subprocess.Popen:
        env = {**os.environ, **RAY_ENV, **kwargs.pop("env", {})}
        process = subprocess.Popen(self.command(host, argv), env=env, **kwargs)
        self.processes.append(process)
        return process

    def run(self, host: Host, argv: list[str], timeout: float, **env) -> subprocess.CompletedProcess:
        result = subprocess.run(self.command(host, argv), env={**os.environ, **RAY_ENV, **env}, capture_output=True,
                                text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:3])} on {host.address} failed:\n{result.stdout[-2000:]}"
                               f"{result.stderr[-2000:]}")
        return result

    def start_ray_head(self, resources: dict, **env) -> str:
        """A Ray head on the head host offering `resources`; returns the cluster's address."""
        self.head.temp_dir = self.head.temp_dir or tempfile.mkdtemp(prefix="nvray", dir="/tmp")  # short: socket paths
        self.run(self.head, [RAY, "start", "--head", f"--node-ip-address={self.head.address}", f"--port={RAY_PORT}",
                             f"--resources={json.dumps(resources)}", "--num-cpus=2", "--include-dashboard=false",
                             "--object-store-memory=200000000", f"--temp-dir={self.head.temp_dir}"], 120, **env)
        return f"{self.head.address}:{RAY_PORT}"

    def start_ray_worker(self, resources: dict) -> None:
        """A Ray worker node on the worker host, joined to the head's cluster (again after `kill_host`)."""
        self.worker.temp_dir = self.worker.temp_dir or tempfile.mkdtemp(prefix="nvray", dir="/tmp")
        self.run(self.worker, [RAY, "start", f"--address={self.head.address}:{RAY_PORT}",
                               f"--node-ip-address={self.worker.address}", f"--resources={json.dumps(resources)}",
                               "--num-cpus=2", "--object-store-memory=200000000",
                               f"--temp-dir={self.worker.temp_dir}"], 120)

    def wait_until_dead(self, host: Host, timeout_s: float = 120) -> None:
        """Until the head has declared the host's Ray node dead: a node started again on the same address
        before that would share its address with a node the head still places actors on."""
        probe = (f"import ray, time; ray.init(address='{self.head.address}:{RAY_PORT}', logging_level='ERROR')\n"
                 f"while any(n['Alive'] and n['NodeManagerAddress'] == '{host.address}' for n in ray.nodes()):\n"
                 f"    time.sleep(0.5)")
        self.run(self.head, [sys.executable, "-c", probe], timeout_s)

    def kill_host(self, host: Host) -> None:
        """SIGKILL every process living in the host's namespace: what a machine that loses power does."""
        for _ in range(5):  # a dying raylet's children may still be forking
            pids = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True).stdout.split()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)

    def destroy(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for host in (self.head, self.worker):
            self.kill_host(host)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
            if host.temp_dir:
                shutil.rmtree(host.temp_dir, ignore_errors=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _serve(host: str) -> None:
    """A BufferService on `host` with fresh run keys: prints its lease endpoint and the keys, serves until
    stdin closes."""
    from nanoverl_async.buffer.service import BufferService
    from nanoverl_async.config import BufferConfig, GeneratorConfig
    from nanoverl_async.wire.auth import run_keys

    keys = run_keys()
    service = BufferService(1, 1, 0, BufferConfig(lease_timeout_s=30), host, GeneratorConfig(replicas=1), 110,
                            lambda index: {"index": index}, curve=keys)
    print(json.dumps({"endpoint": service.endpoints["leases"],
                      "keys": {k: v.decode() for k, v in vars(keys).items()}}), flush=True)
    sys.stdin.read()
    print(json.dumps(service.stats()["leased"]), flush=True)
    service.close()


def _lease(endpoint: str, *keys_jsons: str) -> None:
    """One lease request to `endpoint` per keys, each from a fresh socket, CURVE with those keys or plain
    (""): prints the replies (null: none), in one process since its imports take seconds."""
    from test_wire_auth import lease_request  # beside this file: the same request as the one-host test

    from nanoverl_async.wire.auth import CurveKeys

    keys = [CurveKeys(**{k: v.encode() for k, v in json.loads(j).items()}) if j else None for j in keys_jsons]
    print(json.dumps([lease_request(endpoint, k) for k in keys]), flush=True)


if __name__ == "__main__":
    {"serve": _serve, "lease": _lease}[sys.argv[1]](*sys.argv[2:])
