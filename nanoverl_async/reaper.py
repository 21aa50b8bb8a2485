"""Nothing of a run outlives its launcher: a watcher process that ends the launcher's process tree (or one
process group) when the launcher dies, however it dies (SIGKILL included).

    watcher = Reaper()            # the launcher, before Ray starts
    server = Reaper(group=pgid)   # a generator, right after launching an SGLang server that leads group pgid
    ...
    watcher.release()             # a normal end: the watcher leaves without killing anything

Why: Ray's head processes die with the driver that started them, but the agents its raylet starts
(DashboardAgent, RuntimeEnvAgent) were still alive a minute after a SIGKILL of the launcher, and so would be
any process a role forked. The watcher keeps a fresh list of the launcher's descendants (every POLL_S);
when its pipe from the launcher closes without a word, the launcher is gone, and it kills every process on
the list that is still the same process (pid and start time), orphans included.
With `group`, it watches that process group instead: SIGTERM when the launcher is gone, SIGKILL GRACE_S
later; it leaves by itself once the group is empty, so it never signals a group id reused later. Why a
watcher process and not prctl(PR_SET_PDEATHSIG): the death signal fires when the *thread* that forked the
child exits, and servers are (re)launched from pool threads (sglang_engine.py), so it would kill a healthy
server when its pool thread retires; the pipe closes only when the launcher process is gone.

Run alone: python -m nanoverl_async.reaper PID [GROUP]   (stdin: a pipe held by PID; "release" on it
ends quietly)
"""

from __future__ import annotations

import os

if __name__ == "__main__" and os.fork():  # the watcher detaches at once: Ray kills a worker's own children with it
    os._exit(0)  # (a generator's watcher among them); `Reaper` waits for this first process to leave

import contextlib
import signal
import subprocess
import sys
import threading
import time

import psutil

POLL_S = 0.5  # a process younger than this when the launcher dies may be missed (not a group's member)
GRACE_S = 10.0  # a group: SIGTERM, then SIGKILL this much later
RELEASE = b"release\n"


class Reaper:
    """The launcher's side: starts the watcher in a session of its own (a Ctrl-C or a kill of the
    terminal's process group reaches the run, not the watcher)."""

    def __init__(self, group: int = 0):
        self.process = subprocess.Popen([sys.executable, "-m", "nanoverl_async.reaper", str(os.getpid()),
                                         str(group)], stdin=subprocess.PIPE, start_new_session=True)
        self.process.wait()  # it has forked the watcher (detached) and left

    def release(self) -> None:
        with contextlib.suppress(OSError):  # the watcher is already gone
            self.process.stdin.write(RELEASE)
            self.process.stdin.close()


def descendants(pid: int) -> dict[int, float]:
    """pid -> start time of every process below `pid`."""
    try:
        return {p.pid: p.create_time() for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return {}


def signal_group(group: int, sig: int) -> bool:
    """Send `sig` to process group `group` -> whether it had a member (signal 0: whether it has one)."""
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists
        pass
    return True


def watch(pid: int, group: int = 0) -> None:
    """Poll `pid`'s descendants (or `group`) until stdin closes; then kill them unless the launcher released
    the watcher."""
    seen, message = {}, []  # pid -> start time; what the launcher wrote
    reader = threading.Thread(target=lambda: message.append(sys.stdin.buffer.read()), daemon=True)
    reader.start()
    while reader.is_alive():
        if group and not signal_group(group, 0):
            return  # the group has ended on its own
        if not group:
            seen = {**{p: t for p, t in seen.items() if psutil.pid_exists(p)}, **descendants(pid)}
        reader.join(POLL_S)
    if message == [RELEASE]:
        return
    if group:  # SIGTERM, then SIGKILL GRACE_S later unless the group has emptied by then
        deadline = time.monotonic() + GRACE_S
        if signal_group(group, signal.SIGTERM):
            while time.monotonic() < deadline and signal_group(group, 0):
                time.sleep(0.05)
            signal_group(group, signal.SIGKILL)
        return
    seen.update(descendants(pid))
    seen.pop(os.getpid(), None)  # the watcher is one of the launcher's children too
    for child, started in seen.items():
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(child)
            if process.create_time() == started:  # not a new process that reuses the pid
                process.kill()


if __name__ == "__main__":
    watch(*map(int, sys.argv[1:]))
