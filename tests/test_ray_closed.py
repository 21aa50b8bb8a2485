"""Ray closed to others: a local run's Ray, started by start_ray as every run starts it, is reachable by no
other user of this machine and by no other host. Another local user (uid 65534, through setpriv) tries what a
probe once found open: each of the run's Ray ports on this machine's non-loopback addresses, the control
server (GCS) over loopback without the run's token (its key-value store holds the pickled classes Ray's
workers load), and Ray's session directory with its unix sockets. The same calls with the run's token
succeed: the token, not a broken probe, is what turns the first ones away.
Skips, saying why, without setpriv, or without root to become another user.

Run alone: `python -m pytest tests/test_ray_closed.py -q` (10-40 s on 2 busy cores: a Ray start, four probes).
"""

import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
OTHER_USER = 65534
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}

# A local run's Ray, as the CLI starts it: prints where its pieces are, lives until stdin closes.
DRIVER = """
import json, os, sys
import ray
from nanoverl_async.config import load_config
from nanoverl_async.controller.startup import start_ray

start_ray(load_config(None).ray)
node = ray.nodes()[0]
print(json.dumps({"gcs": ray.get_runtime_context().gcs_address, "sockets": [node["RayletSocketName"],
                  node["ObjectStoreSocketName"]], "token": os.environ.get("RAY_AUTH_TOKEN", "")}), flush=True)
sys.stdin.read()
"""

# What the other user tries; prints each outcome: "ok" or the errno's name (the exception's, for the GCS).
PROBE = """
import errno, json, os, socket, sys
from ray._raylet import GcsClient

tries = json.loads(sys.argv[1])
def outcome(attempt):
    try:
        attempt()
        return "ok"
    except OSError as error:
        return errno.errorcode.get(error.errno, repr(error))
    except Exception as error:
        return f"{type(error).__name__}: {str(error).split('. ')[0]}"
def connect(family, kind, address):
    with socket.socket(family, kind) as probe:
        probe.settimeout(10)
        probe.connect(address)
def gcs():
    client = GcsClient(address=tries["gcs"])
    client.internal_kv_put(b"planted", b"code", True, b"probe", timeout=10)
    assert client.internal_kv_keys(b"planted", b"probe", timeout=10) == [b"planted"]

print(json.dumps({
    "uid": os.getuid(),
    "tcp": {f"{host} {port}": outcome(lambda: connect(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                                      socket.SOCK_STREAM, (host, port)))
            for host in tries.get("hosts", []) for port in tries.get("ports", [])},
    "gcs": outcome(gcs) if "gcs" in tries else None,
    "files": {path: outcome(lambda: os.listdir(path) if os.path.isdir(path) else open(path).read())
              for path in tries.get("files", [])},
    "sockets": {path: outcome(lambda: connect(socket.AF_UNIX, socket.SOCK_STREAM, path))
                for path in tries.get("sockets", [])},
}))
"""


def as_other_user(tries: dict, **env) -> dict:
    """PROBE as uid 65534, no groups, no capabilities, without this process's Ray settings (+ `env`)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    result = subprocess.run(["setpriv", f"--reuid={OTHER_USER}", f"--regid={OTHER_USER}", "--clear-groups",
                             sys.executable, "-c", PROBE, json.dumps(tries)], cwd="/", capture_output=True,
                            text=True, timeout=120, env={**clean, "HOME": "/nonexistent", **env})
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = json.loads(result.stdout.splitlines()[-1])
    assert outcomes.pop("uid") == OTHER_USER
    return outcomes


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.skip("another local user's view needs setpriv (util-linux) and root to become uid 65534")
    home = tmp_path_factory.mktemp("home")  # where Ray would store a token it generated (~/.ray/auth_token)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**clean, "HOME": str(home)})
    try:
        line = driver.stdout.readline()
        assert line, "the run's Ray did not start (its error is above)"
        started = json.loads(line)
        ray = [driver.pid] + [child.pid for child in psutil.Process(driver.pid).children(recursive=True)]
        listening = [(psutil.Process(pid).name(), conn.laddr) for pid in ray
                     for conn in psutil.Process(pid).net_connections("inet") if conn.status == psutil.CONN_LISTEN]
        yield {**started, "listening": listening, "home": home, "pid": driver.pid}
    finally:
        driver.stdin.close()
        driver.wait(timeout=60)


def non_loopback_addresses() -> list[str]:
    """This machine's own addresses that other hosts reach it on (link-local IPv6 needs a scope: left out)."""
    found = [address.address for addresses in psutil.net_if_addrs().values() for address in addresses
             if address.family in (socket.AF_INET, socket.AF_INET6)]
    return [a for a in found if not ipaddress.ip_address(a).is_loopback and not ipaddress.ip_address(a).is_link_local]


def test_every_ray_port_of_a_local_run_is_on_loopback_and_refused_on_this_machines_other_addresses(local_ray):
    listening = local_ray["listening"]
    assert {"gcs_server", "raylet"} <= {name for name, _ in listening}  # the control server and the node's
    assert sorted({address.ip for _, address in listening} - LOOPBACK) == [], listening
    hosts, ports = non_loopback_addresses(), sorted({address.port for _, address in listening})
    outcomes = as_other_user({"hosts": hosts, "ports": ports})
    assert outcomes["tcp"] == {f"{host} {port}": "ECONNREFUSED" for host in hosts for port in ports}


def test_the_control_server_turns_away_another_user_without_the_runs_token(local_ray):
    tries = {"gcs": local_ray["gcs"]}
    refused = "AuthenticationError: RPC error: InvalidAuthToken: Authentication token is missing or incorrect"
    assert as_other_user(tries)["gcs"] == refused  # nothing written, nothing listed
    assert as_other_user(tries, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=local_ray["token"])["gcs"] == "ok"
    assert not (local_ray["home"] / ".ray").exists()  # the run's token is in no file: in its processes' environment


def test_the_session_directory_its_sockets_and_the_token_are_closed_to_another_user(local_ray):
    raylet, plasma = local_ray["sockets"]
    session = Path(raylet).parents[1]
    private = session.parents[1]  # the run's own directory; Ray makes the ones it creates world-writable
    environment = f"/proc/{local_ray['pid']}/environ"  # holds the token
    tries = {"files": [str(private), str(session), str(session / "logs"), environment], "sockets": [raylet, plasma]}
    outcomes = as_other_user(tries)
    assert outcomes["files"] == dict.fromkeys(tries["files"], "EACCES")
    assert outcomes["sockets"] == {raylet: "EACCES", plasma: "EACCES"}
    assert os.stat(private).st_mode & 0o777 == 0o700
