"""A sandboxed Python tool: run model-written code under OS isolation (bubblewrap), with hard limits.

    from nanoverl_async.agents.sandbox import python          # a tool: async def python(code: str) -> str
    class MyEnv(Environment):
        tools = [python]

    result = await run_python("print(2**10)", SandboxLimits(cpu_s=2, wall_s=5))   # SandboxResult

What confines the code (isolation "bwrap", the default; `agent.sandbox` in the config):
  - bubblewrap (`bwrap`, Debian package bubblewrap) puts it in fresh user, PID, network, IPC, UTS and
    mount namespaces, in a new session (no TIOCSTI into our terminal), with no capabilities and
    no_new_privs (setuid binaries do not raise it);
  - it runs as uid/gid 65534 on the kernel's side too: started as root, bwrap joins a user namespace
    made once per process that maps only 0 (bwrap's own mount setup) and 65534, and `setpriv` drops to
    65534 before the interpreter starts; started as another user, the code runs as that user mapped to
    65534. So RLIMIT_NPROC holds (the kernel never applies it to uid 0), counted per user namespace:
    concurrent calls of one process share the `max_processes` count;
  - it sees a read-only /usr (and the /bin, /lib* beside it), /etc/ld.so.cache and this Python's prefix
    and base prefix (a venv's site-packages with it), nothing else of the host: no home, no /root, no
    /etc/shadow, no /work; a private size-capped tmpfs is /tmp and the working directory, the rest of the
    root is read-only; a fresh /proc shows only the sandbox's processes, /dev only null, zero, random..;
  - no network: a network namespace with only its own loopback (host ports and abstract sockets unreachable);
  - rlimits set by the interpreter before it reads the code (RUNNER): CPU seconds (SIGXCPU at `cpu_s`,
    SIGKILL a second later), address space (a huge allocation raises MemoryError), file size, open files,
    processes, no core dumps; a wall clock: bwrap is killed at `wall_s` and, being PID 1's parent
    (--die-with-parent), takes the whole PID namespace with it; when the code's main process exits, bwrap
    exits too and the kernel kills whatever it left running.
  The interpreter starts with -I -S: this Python's site-packages are put on its path, but their .pth files
  are not run (an editable install's finder, say, which took half of a call's time).
  Not filtered (no seccomp): system calls as such; the code may make a nested user namespace of its own,
  which gives it nothing outside the sandbox (the mounts stay locked read-only).
Where bubblewrap is missing or cannot create namespaces (probed once per process), `run_python` refuses
with SandboxUnavailable, one line saying what to install, unless the isolation is "unsafe_no_isolation":
then only the rlimits, the wall clock (on the process group) and a temporary working directory apply;
the code runs as this user and can read, write and connect to whatever this user can.

Invariants: `run_python` never raises for anything the code does (infinite loop, huge allocation, fork
bomb, escape attempt, crash, output without end): it returns a SandboxResult whose `error` says what
happened within `wall_s` + KILL_GRACE_S seconds, and leaves no process behind (unisolated: none in its
process group). stdout+stderr are cut to `max_output_chars` (head and tail kept); output printed before
the wall clock stopped the code is kept.

Run alone: `python -m pytest tests/test_sandbox.py -q`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import functools
import os
import shutil
import signal
import site
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

ISOLATIONS = ("bwrap", "unsafe_no_isolation")
BWRAP = "bwrap"  # looked up on PATH
NOBODY = 65534
CLONE_NEWUSER = 0x10000000
NAMESPACES = ("--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
              "--die-with-parent", "--new-session")
ENVIRONMENT = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONIOENCODING": "utf-8", "LANG": "C.UTF-8"}
KILL_GRACE_S = 0.5  # after the kill: for the process to be reaped and its last output read
SITE_PACKAGES = ":".join(site.getsitepackages())  # this process's: a venv's (under -S the child would not know it)

# The interpreter's first code (under -S): this Python's site-packages on the path (argv[1]) and the builtins
# site adds that programs use (exit, quit, help); then the rlimits (argv: NAME=soft:hard); then the program
# from stdin. The rlimits in the interpreter, not before exec, so that bwrap's own processes do not count
# towards RLIMIT_NPROC.
RUNNER = """import resource, site, sys
sys.path += filter(None, sys.argv[1].split(":"))
site.setquit(), site.sethelper()
for limit in sys.argv[2:]:
    name, values = limit.split("=")
    resource.setrlimit(getattr(resource, name), tuple(map(int, values.split(":"))))
del sys.argv[1:], limit, name, values
exec(compile(sys.stdin.read(), "<code>", "exec"), {"__name__": "__main__"})
"""


class SandboxUnavailable(RuntimeError):
    """Isolation was asked for and this machine cannot provide it (the message says what to install)."""


@dataclass
class SandboxLimits:
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU: SIGXCPU, SIGKILL one second later)
    wall_s: float = 10.0  # wall clock, then the sandbox is killed
    memory_mb: int = 512  # address space (RLIMIT_AS)
    file_mb: int = 16  # largest file the code may write (RLIMIT_FSIZE)
    tmp_mb: int = 64  # size of the private /tmp (bwrap)
    # RLIMIT_NPROC: uid 65534's processes in the sandbox's user namespace (as root: the interpreter and its
    # children, shared by concurrent calls of this process; as another user: also bwrap's PID 1)
    max_processes: int = 64
    max_output_chars: int = 4000  # stdout+stderr beyond this is cut
    isolation: str = "bwrap"  # bwrap | unsafe_no_isolation (no isolation: only rlimits and the wall clock)

    def __post_init__(self):
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"sandbox isolation must be one of {ISOLATIONS}, got {self.isolation!r}")


@dataclass
class SandboxResult:
    output: str  # stdout and stderr interleaved, truncated
    returncode: Optional[int]
    error: Optional[str]  # None on success; "timeout", "cpu time limit", "exit code 1", ...
    isolation: str = "bwrap"

    def observation(self) -> str:
        return self.output if self.error is None else f"error: {self.error}\n{self.output}".rstrip()


TOOL_LIMITS = SandboxLimits()  # what the `python` tool runs under


def set_isolation(isolation: str) -> None:
    """The `python` tool's isolation in this process (the run's `agent.sandbox`)."""
    global TOOL_LIMITS
    TOOL_LIMITS = dataclasses.replace(TOOL_LIMITS, isolation=isolation)  # SandboxLimits checks it


def refusal(why: str) -> str:
    return (f"sandbox: {why}; install bubblewrap (apt-get install bubblewrap) on a kernel that allows user "
            f"namespaces, or set agent.sandbox=unsafe_no_isolation to run model-written code without isolation")


@dataclass(frozen=True)
class _Bwrap:
    args: tuple  # bwrap and its namespaces
    fds: tuple  # file descriptors they name (the user namespace, as root)
    drop: tuple  # command prefix that becomes uid 65534 (as root: setpriv)
    binds: tuple = ()  # the read-only filesystem (_filesystem), mounted after the private /tmp


def unavailable() -> Optional[str]:
    """Why bubblewrap cannot isolate code on this machine (None: it can); checked once per process."""
    found = _bwrap()
    return found if isinstance(found, str) else None


@functools.lru_cache(maxsize=None)
def _bwrap() -> Union[_Bwrap, str]:
    """How to start a sandbox here, found once per process; a str says why there is none."""
    path = shutil.which(BWRAP)
    if path is None:
        return f"bubblewrap ({BWRAP}) is not installed"
    if os.geteuid() != 0:
        sandbox = _Bwrap((path, "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)), (), ())
    else:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            return "setpriv (util-linux) is not installed"
        try:
            userns = _user_namespace()
        except (OSError, subprocess.SubprocessError) as error:
            return f"cannot create a user namespace ({error})"
        sandbox = _Bwrap((path, "--userns", str(userns)), (userns,),
                         (setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
                          "--bounding-set=-all", "--"))
    sandbox = dataclasses.replace(sandbox, args=sandbox.args + NAMESPACES, binds=_filesystem())
    try:
        probe = subprocess.run([*_argv(sandbox, SandboxLimits()), "/bin/true"], pass_fds=sandbox.fds,
                               stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as error:
        return f"bubblewrap cannot run ({error})"
    if probe.returncode != 0:
        return f"bubblewrap cannot isolate here ({(probe.stderr.strip() or 'no message').splitlines()[-1]})"
    return sandbox


def _user_namespace() -> int:
    """(As root) a user namespace mapping only 0 and 65534, as an fd bwrap joins: bwrap mounts as its 0,
    which may read a root-only folder above the interpreter; the code then runs as 65534, which is not root
    on the host. Made once: one per call would cost a fork of this (possibly large) process."""
    libc = ctypes.CDLL(None, use_errno=True)

    def unshare() -> None:
        if libc.unshare(CLONE_NEWUSER) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")

    holder = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, preexec_fn=unshare)
    try:
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{holder.pid}/{name}", "w") as ids:
                ids.write(f"0 0 1\n{NOBODY} {NOBODY} 1\n")
        return os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        holder.communicate(b"")


def _filesystem() -> tuple:
    """Read-only binds of what the interpreter needs: /usr, the /bin and /lib* beside it, the loader's
    cache, this Python's prefixes (the folders above them readable: the real ones, e.g. /root, may not be)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    args += [*_parents("/etc/ld.so.cache"), "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for prefix in sorted({sys.base_prefix, sys.prefix}):
        if prefix != "/usr" and not prefix.startswith("/usr/"):
            args += [*_parents(prefix), "--ro-bind", prefix, prefix]
    return tuple(args + ["--proc", "/proc", "--dev", "/dev", "--clearenv"]
                 + [arg for key, value in ENVIRONMENT.items() for arg in ("--setenv", key, value)])


def _parents(path: str) -> list:
    """bwrap arguments that make `path`'s folders 0755 (bwrap would make them 0700: nobody could look in)."""
    return [arg for folder in reversed(Path(path).parents[:-1]) for arg in ("--dir", str(folder))]


def _argv(sandbox: _Bwrap, limits: SandboxLimits) -> list:
    """bwrap's command line up to the program: the private /tmp, then the read-only binds (an interpreter under
    /tmp, say a venv in a checkout there, stays visible above it), the read-only root, the drop to 65534."""
    return [*sandbox.args, "--perms", "1777", "--size", str(limits.tmp_mb << 20), "--tmpfs", "/tmp", *sandbox.binds,
            "--remount-ro", "/", "--chdir", "/tmp", "--", *sandbox.drop]


def _rlimits(limits: SandboxLimits) -> list:
    cpu = limits.cpu_s
    memory = limits.memory_mb << 20
    files = limits.file_mb << 20
    return [f"RLIMIT_CPU={cpu}:{cpu + 1}", f"RLIMIT_AS={memory}:{memory}", f"RLIMIT_FSIZE={files}:{files}",
            f"RLIMIT_NPROC={limits.max_processes}:{limits.max_processes}", "RLIMIT_NOFILE=64:64", "RLIMIT_CORE=0:0"]


async def run_python(code: str, limits: Optional[SandboxLimits] = None) -> SandboxResult:
    """Run `code` isolated under `limits` (default: the tool's) -> SandboxResult (never raises for the code;
    raises SandboxUnavailable when isolation is asked for and missing)."""
    limits = limits or TOOL_LIMITS
    interpreter = [sys.executable, "-I", "-S", "-c", RUNNER, SITE_PACKAGES, *_rlimits(limits)]
    if limits.isolation != "bwrap":
        with tempfile.TemporaryDirectory(prefix="nanoverl_sandbox_", ignore_cleanup_errors=True) as workdir:
            return await _run(interpreter, code, limits, cwd=workdir)
    sandbox = _bwrap()
    if isinstance(sandbox, str):
        raise SandboxUnavailable(refusal(sandbox))
    return await _run(_argv(sandbox, limits) + interpreter, code, limits, cwd="/", fds=sandbox.fds)


async def _run(argv: list, source: str, limits: SandboxLimits, cwd: str, fds: tuple = ()) -> SandboxResult:
    """Start `argv` in a session of its own, feed it `source`, collect its output; kill it at limits.wall_s."""
    # The output comes through a pipe of ours, not asyncio's: Process.wait() waits for its pipes to close too,
    # which a process still writing (or, unisolated, one that left the group) keeps open.
    read_end, write_end = os.pipe()
    pipe, output = await asyncio.get_running_loop().connect_read_pipe(
        lambda: _Output(limits.max_output_chars * 4), open(read_end, "rb", buffering=0))
    try:
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=write_end, stderr=write_end, start_new_session=True,
                pass_fds=fds, cwd=cwd, env=ENVIRONMENT)
        finally:
            os.close(write_end)  # the child has it: the output ends when the last process holding it does
        error = await _supervise(process, source, output, limits.wall_s)
    finally:
        pipe.close()
    text = output.data.decode("utf-8", errors="replace")
    if len(text) > limits.max_output_chars:  # keep the head and the tail (where the error is)
        half = limits.max_output_chars // 2
        text = f"{text[:half]}\n... ({len(text) - 2 * half} chars cut) ...\n{text[-half:]}"
    code = process.returncode
    if error is None and code != 0:
        error = _exit_reason(code, bwrap=limits.isolation == "bwrap")
    return SandboxResult(text, code, error, limits.isolation)


class _Output(asyncio.Protocol):
    """Reads a pipe to its end, keeping the first `keep` bytes: the writer never waits for a reader."""

    def __init__(self, keep: int):
        self.keep, self.data = keep, bytearray()
        self.ended = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.data += data[:self.keep - len(self.data)]

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if not self.ended.done():
            self.ended.set_result(None)


async def _supervise(process: asyncio.subprocess.Process, source: str, output: _Output, wall_s: float) -> Optional[str]:
    """Feed `source`, wait for the exit and the end of the output, kill at `wall_s` -> None or why it stopped."""
    async def ended() -> None:
        await process.wait()
        await asyncio.wait({output.ended})  # not awaited itself: a timeout would cancel the future

    async def run() -> None:
        process.stdin.write(source.encode())
        await process.stdin.drain()
        process.stdin.close()
        await ended()

    try:
        await asyncio.wait_for(run(), wall_s)
        return None
    except asyncio.TimeoutError:
        return "wall time limit"
    except (BrokenPipeError, ConnectionResetError):
        return "the process closed its input"
    finally:  # kill bwrap (PID 1's parent: the sandbox goes with it) or the unisolated group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(asyncio.TimeoutError):  # unisolated, a process that left the group may write on
            await asyncio.wait_for(ended(), KILL_GRACE_S)


def _exit_reason(code: int, bwrap: bool) -> str:
    """bwrap reports a signal s as exit code 128 + s; a plain child as -s."""
    signum = -code if code < 0 else code - 128 if bwrap and code > 128 else 0
    if signum in (signal.SIGXCPU, signal.SIGKILL):  # SIGKILL: the hard CPU limit, SIGXCPU ignored
        return "cpu time limit"
    return f"killed by signal {signum}" if signum else f"exit code {code}"


async def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it prints (stdout and stderr).

    Args:
        code: a complete Python program; print the results you want to see.
    """
    return (await run_python(code)).observation()
