"""An SGLang server process never outlives the process that launched it (generators/sglang_server.py).

Fast tier (a stand-in server: a Python sleeper that spawns a grandchild, so process-group handling shows):
the launcher process is SIGKILLed and the server, its grandchild and its watcher (reaper.py) are gone
within seconds; a server launched from a short-lived thread survives that thread's exit (the reason for the
watcher rather than PR_SET_PDEATHSIG), `stop` takes down its whole process group and the watcher, and a
restart after the server was killed clears what it left behind. Slow tier:
the fake SGLang server (tests/fake_sglang_server.py), healthy, dies with its SIGKILLed launcher, and a Ray
actor that launched one from a worker thread takes it down when `ray.kill`ed.

Every process of one test carries a unique token in its command line (the `--model-path`), so the test
finds them all in /proc: the server and its children; the watcher's command line names the server's group.
Run alone: `python -m pytest tests/test_sglang_server_lifetime.py -q`.
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from nanoverl_async.config import SGLangConfig
from nanoverl_async.generators.sglang_server import SGLangServer

FAKE = str(Path(__file__).with_name("fake_sglang_server.py"))
REPO = str(Path(__file__).resolve().parents[1])
# The stand-in server: spawns a grandchild (same argv, so it carries the token), then sleeps.
STANDIN = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', "
           "*sys.argv[1:]]); time.sleep(600)")
# The launcher: launches from a thread that then exits, prints the server pid, and waits to be killed.
LAUNCHER = """
import sys, threading, time
from nanoverl_async.config import SGLangConfig
from nanoverl_async.generators.sglang_server import SGLangServer
model_path, port, start, command = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "start", sys.argv[4:]
server = SGLangServer(model_path, port, SGLangConfig(launch_timeout_s=120), command=command)


def launch():
    server.launch()
    if start:
        server.wait_ready()


launcher = threading.Thread(target=launch)
launcher.start()
launcher.join()
print("server-pid", server.process.pid, flush=True)
time.sleep(600)
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (an unreaped dead process)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def carrying(token: str) -> list[int]:
    """Live pids whose command line contains `token`."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    if token.encode() in cmdline.read() and running(int(entry)):
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def watcher(group: int) -> list[int]:
    """Live pids of the watcher of process group `group` (python -m nanoverl_async.reaper PID GROUP)."""
    return [pid for pid in carrying(f"\0{group}\0") if pid in carrying("nanoverl_async.reaper\0")]


def described(pids: list[int]) -> list[str]:
    """Each pid with its state and command line, for a failure's message."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                command = cmdline.read().replace(b"\0", b" ")[:120].decode()
            out.append(f"{pid} {command}")
        except OSError:
            out.append(f"{pid} (gone)")
    return out


def wait_until(condition, timeout_s: float, what) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what() if callable(what) else what}"
        time.sleep(0.05)


def standin_command() -> list[str]:
    return [sys.executable, "-c", STANDIN]


def run_launcher(token: str, port: int, command: list[str], start: bool) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, token, str(port), "start" if start else "launch",
                                 *command], stdout=subprocess.PIPE, text=True, env=env)
    try:
        for line in launcher.stdout:  # the server shares this stdout: skip its lines
            if line.startswith("server-pid "):
                return launcher, int(line.split()[1])
        raise AssertionError(f"the launcher exited with code {launcher.wait()} before reporting the server pid")
    except BaseException:
        launcher.kill()  # its watcher then takes the server down
        launcher.stdout.close()
        raise


def kill_leftovers(token: str) -> None:
    for pid in carrying(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_server_and_its_group_die_with_a_sigkilled_launcher(tmp_path):
    token = str(tmp_path / f"model-{uuid.uuid4().hex}")
    launcher, server_pid = run_launcher(token, free_port(), standin_command(), start=False)
    try:
        # server + grandchild (the launcher's own argv carries the token too) + watcher
        wait_until(lambda: len(set(carrying(token)) - {launcher.pid}) >= 2 and watcher(server_pid), 20,
                   "server, grandchild, watcher up")
        assert running(server_pid) and os.getpgid(server_pid) == server_pid  # leads its own group
        launcher.kill()  # SIGKILL: no atexit, no close()
        launcher.wait(10)
        wait_until(lambda: not running(server_pid), 5, "the server dies with its launcher")
        wait_until(lambda: not carrying(token) and not watcher(server_pid), 5,
                   f"nothing of it left: {carrying(token)}, watcher {watcher(server_pid)}")
    finally:
        launcher.kill()
        launcher.stdout.close()
        kill_leftovers(token)


def test_server_launched_from_a_short_lived_thread_outlives_the_thread(tmp_path):
    token = str(tmp_path / f"model-{uuid.uuid4().hex}")
    server = SGLangServer(token, free_port(), SGLangConfig(), command=standin_command())
    try:
        thread = threading.Thread(target=server.launch)  # like asyncio.to_thread(server.restart, ...)
        thread.start()
        thread.join()
        pid = server.process.pid
        wait_until(lambda: len(carrying(token)) >= 2 and watcher(pid), 20, "server, grandchild, watcher up")
        time.sleep(1.5)  # well past the watcher's poll period (and any thread-death signal)
        assert server.alive() and running(pid) and len(carrying(token)) >= 2 and watcher(pid)
        server.stop(timeout_s=10)
        assert server.process is None and not running(pid)
        wait_until(lambda: not watcher(pid), 5, "the released watcher leaves")
        wait_until(lambda: not carrying(token), 5, f"stop leaves nothing: {carrying(token)}")
    finally:
        server.close()
        kill_leftovers(token)


def test_restart_after_the_server_was_killed_clears_its_whole_group(tmp_path):
    token = str(tmp_path / f"model-{uuid.uuid4().hex}")
    server = SGLangServer(token, free_port(), SGLangConfig(), command=standin_command())
    try:
        server.launch()
        first = server.process.pid
        wait_until(lambda: len(carrying(token)) >= 2 and watcher(first), 20, "server, grandchild, watcher up")
        old = set(carrying(token) + watcher(first))
        server.process.kill()  # the server dies, its child lives on (as a crashed sglang's scheduler might)
        wait_until(lambda: not server.alive(), 5, "the server is dead")
        assert len(set(carrying(token) + watcher(first)) & old) == 2  # the orphaned grandchild and the watcher
        server.wait_ready = lambda: None  # restart without waiting for /health (the stand-in serves none)
        thread = threading.Thread(target=server.restart, args=(token,))
        thread.start()
        thread.join()
        wait_until(lambda: not set(carrying(token) + watcher(first)) & old, 5,
                   f"the old group and watcher are gone: {old}")
        wait_until(lambda: len(carrying(token)) >= 2 and watcher(server.process.pid), 20,
                   "the new server, grandchild, watcher up")
        assert server.restarts == 1 and server.alive()
    finally:
        server.close()
        kill_leftovers(token)


def test_a_missing_server_command_fails_at_launch(tmp_path):
    server = SGLangServer(str(tmp_path), free_port(), SGLangConfig(), command=["/nonexistent/sglang-server"])
    with pytest.raises(FileNotFoundError):
        server.launch()
    assert server.process is None
    server.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from sglang_helpers import tiny_qwen2  # torch and transformers: only the slow tests pay for them

    path = tmp_path_factory.mktemp(f"qwen2-{uuid.uuid4().hex}")
    tiny_qwen2(0).save_pretrained(path)
    return str(path)


@pytest.mark.slow  # a fake server process loads torch and transformers: seconds
def test_healthy_fake_server_dies_with_a_sigkilled_launcher(model_dir):
    port = free_port()
    launcher, server_pid = run_launcher(model_dir, port, [sys.executable, FAKE], start=True)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # healthy and listening
        launcher.kill()
        launcher.wait(10)
        wait_until(lambda: not running(server_pid), 5, "the fake server dies with its launcher")
        wait_until(lambda: not carrying(model_dir), 5, f"nothing of it left: {carrying(model_dir)}")
        # the port is free again (its listening socket closes as the last of the server's threads exits,
        # a moment after the process shows as dead)
        wait_until(lambda: port_free(port), 5, f"port {port} free again")
    finally:
        launcher.kill()
        launcher.stdout.close()
        kill_leftovers(model_dir)


@pytest.mark.slow  # Ray starts (once per session) and an actor process starts
def test_server_dies_with_its_ray_killed_actor(ray_session, tmp_path):
    import ray

    @ray.remote(num_cpus=0)
    class Launcher:
        def launch(self, token: str, port: int, command: list[str]) -> int:
            import asyncio

            from nanoverl_async.config import SGLangConfig
            from nanoverl_async.generators.sglang_server import SGLangServer

            self.server = SGLangServer(token, port, SGLangConfig(), command=command)
            asyncio.run(asyncio.to_thread(self.server.launch))  # from a pool thread, as a restart does
            return self.server.process.pid

    token = str(tmp_path / f"model-{uuid.uuid4().hex}")
    actor = Launcher.remote()
    try:
        server_pid = ray.get(actor.launch.remote(token, free_port(), standin_command()), timeout=120)
        wait_until(lambda: len(carrying(token)) >= 2 and watcher(server_pid), 20, "server, grandchild, watcher up")
        time.sleep(1.0)
        assert running(server_pid)  # the pool thread is gone by now: the server is not
        ray.kill(actor)
        wait_until(lambda: not running(server_pid), 15, "the server dies with its actor")
        wait_until(lambda: not carrying(token) and not watcher(server_pid), 5,
                   lambda: f"nothing of it left: {described(carrying(token) + watcher(server_pid))}")
    finally:
        ray.kill(actor)
        kill_leftovers(token)
