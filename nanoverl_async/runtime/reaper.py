"""Nothing of a run outlives its launcher: a watcher process that ends the launcher's process tree when the
launcher dies, however it dies (SIGKILL included).

    watcher = Reaper()    # the launcher, before Ray starts
    ...
    watcher.release()     # a normal end: the watcher leaves without killing anything

Why: Ray's head processes die with the driver that started them, but the agents its raylet starts
(DashboardAgent, RuntimeEnvAgent) were still alive a minute after a SIGKILL of the launcher, and so would be
any process a role forked. The watcher keeps a fresh list of the launcher's descendants (every POLL_S);
when its pipe from the launcher closes without a word, the launcher is gone, and it kills every process on
the list that is still the same process (pid and start time), orphans included.

Run alone: python -m nanoverl_async.runtime.reaper PID   (stdin: a pipe held by PID; "release" on it ends quietly)
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psutil

POLL_S = 0.5  # a process younger than this when the launcher dies may be missed
RELEASE = b"release\n"


class Reaper:
    """The launcher's side: starts the watcher in a session of its own (a Ctrl-C or a kill of the
    terminal's process group reaches the run, not the watcher)."""

    def __init__(self):
        self.process = subprocess.Popen([sys.executable, "-m", "nanoverl_async.runtime.reaper", str(os.getpid())],
                                        stdin=subprocess.PIPE, start_new_session=True)

    def release(self) -> None:
        try:
            self.process.stdin.write(RELEASE)
            self.process.stdin.close()
        except OSError:  # the watcher is already gone
            pass
        self.process.wait(timeout=10)


def descendants(pid: int) -> dict[int, float]:
    """pid -> start time of every process below `pid`."""
    try:
        return {p.pid: p.create_time() for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return {}


def kill_all(processes: dict[int, float]) -> None:
    for pid, started in processes.items():
        try:
            process = psutil.Process(pid)
            if process.create_time() == started:  # not a new process that reuses the pid
                process.kill()
        except psutil.Error:
            pass


def watch(pid: int) -> None:
    """Poll `pid`'s descendants until stdin closes; kill them unless the launcher released the watcher."""
    seen: dict[int, float] = {}
    message = []
    reader = threading.Thread(target=lambda: message.append(sys.stdin.buffer.read()), daemon=True)
    reader.start()
    while reader.is_alive():
        seen = {**{p: t for p, t in seen.items() if psutil.pid_exists(p)}, **descendants(pid)}
        reader.join(POLL_S)
    if message != [RELEASE]:
        seen.update(descendants(pid))
        seen.pop(os.getpid(), None)  # the watcher is one of the launcher's children too
        kill_all(seen)


if __name__ == "__main__":
    watch(int(sys.argv[1]))
