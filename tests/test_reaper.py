"""Nothing of a run outlives its launcher (reaper.py): a launcher killed by SIGKILL takes its whole process
tree along, orphans included, within a few seconds; a launcher that ends normally kills nothing."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    from nanoverl_async.reaper import Reaper
    watcher = Reaper()
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
        "o = subprocess.Popen(['sleep', '60'], start_new_session=True); print(o.pid, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    orphan = child.stdout.readline().strip()
    time.sleep(1.5)  # the watcher's list is fresh
    print(child.pid, orphan, flush=True)
    if sys.argv[1] == "release":
        watcher.release()
        print("released", flush=True)
    time.sleep(60)
""")


def start_launcher(mode: str):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, mode], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in launcher.stdout.readline().split()]
    return launcher, pids


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_a_killed_launcher_takes_its_processes_along_orphans_included():
    launcher, pids = start_launcher("keep")
    assert all(alive(p) for p in pids)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    left = wait_gone(pids, 5.0)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []


def test_a_released_watcher_kills_nothing():
    launcher, pids = start_launcher("release")
    assert launcher.stdout.readline().strip() == "released"
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    time.sleep(1.0)
    try:
        assert all(alive(p) for p in pids)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
