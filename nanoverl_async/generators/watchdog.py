"""A server process that never outlives the process that launched it, however that one dies.

    process, lifeline = spawn_watched(["python", "-m", "sglang.launch_server", ...])
    ...                         # the server runs; keep `lifeline` (a pipe's write end) open meanwhile
    os.close(lifeline)          # after stopping it: lets the watchdog exit

Why a watchdog and not prctl(PR_SET_PDEATHSIG): the death signal fires when the *thread* that forked the
child exits, and servers are (re)launched from pool threads (asyncio.to_thread(server.restart) in
sglang_engine.py), so a bare PDEATHSIG kills a healthy server when its pool thread retires.

How: `spawn_watched` starts this module as a trampoline in a new session (the server's process group).
The trampoline double-forks a watchdog, then execs the server in place, so `Popen.pid` *is* the server
(poll, kill and returncode stay exact) and the server never runs unwatched. The watchdog, orphaned at
once so the server never has to reap it, blocks on the read end of a pipe whose only write end the
launcher keeps (os.pipe fds are not inherited by other children): EOF means every holder of the write
end is dead, i.e. the launcher process, whichever thread launched. It then SIGTERMs the server's group and
SIGKILLs it `grace_s` later. It exits by itself within 0.5 s of the group emptying (the server stopped,
or died and was reaped), so it never signals a group id reused much later. Caveat: a child the launcher
forks *without* exec inherits the write end, which delays the watchdog until that child exits too.
Linux/POSIX only (fork, setsid, killpg). Run alone: tests/test_sglang_server_lifetime.py.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

GRACE_S = 10.0  # the launcher is gone: SIGTERM the server's group, SIGKILL it this much later
POLL_S = 0.5


def spawn_watched(args: list[str], grace_s: float = GRACE_S) -> tuple[subprocess.Popen, int]:
    """Start `args` as the leader of a new session, guarded by a watchdog that kills its process group
    once this process is gone. Returns the process (its pid is the server's) and the write end of the
    lifeline pipe, which the caller keeps open while the server should live."""
    read_end, write_end = os.pipe()  # non-inheritable: only the trampoline gets the read end (pass_fds)
    try:
        process = subprocess.Popen([sys.executable, "-m", __name__, str(read_end), str(grace_s), *args],
                                   env=dict(os.environ), pass_fds=(read_end,), start_new_session=True)
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    return process, write_end


def signal_group(pgid: int, sig: int) -> None:
    """Send `sig` to process group `pgid`; an empty group is not an error."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: it exists
        pass
    return True


def watch(lifeline_fd: int, pgid: int, grace_s: float) -> None:
    """Wait for EOF on the lifeline (the launcher is gone), then SIGTERM and, after grace_s, SIGKILL
    the group; return early whenever the group is already empty."""
    while True:  # the launcher never writes: readable and empty is EOF
        if select.select([lifeline_fd], [], [], POLL_S)[0] and not os.read(lifeline_fd, 64):
            break
        if not group_alive(pgid):
            return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        if not group_alive(pgid):
            return
        try:
            os.killpg(pgid, sig)
        except OSError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and group_alive(pgid):
            time.sleep(0.05)


def start_watchdog(lifeline_fd: int, pgid: int, grace_s: float) -> None:
    """Double-fork the watchdog into its own session (killing the server's group or the launcher's
    spares it), holding none of the launcher's pipes open (a reader of them would wait for our EOF)."""
    child = os.fork()
    if child == 0:
        if os.fork() == 0:
            os.setsid()
            os.chdir("/")
            null = os.open(os.devnull, os.O_RDWR)
            for std in (0, 1, 2):
                os.dup2(null, std)
            try:
                watch(lifeline_fd, pgid, grace_s)
            finally:
                os._exit(0)
        os._exit(0)
    os.waitpid(child, 0)


def main() -> None:
    """The trampoline: `python -m nanoverl_async.generators.watchdog FD GRACE_S ARGV...`."""
    lifeline_fd, grace_s, argv = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
    start_watchdog(lifeline_fd, os.getpgid(0), grace_s)
    os.close(lifeline_fd)
    for name in ("SIGPIPE", "SIGXFSZ"):  # Python starts with these ignored; the server gets the defaults
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        os.execvp(argv[0], argv)
    except OSError as error:
        print(f"cannot launch {argv[0]}: {error}", file=sys.stderr, flush=True)
        os._exit(127)


if __name__ == "__main__":
    main()
