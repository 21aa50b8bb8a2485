"""A sandboxed Python tool: run untrusted code in a killable subprocess with hard limits.

    from nanoverl_async.sandbox import python          # a tool: async def python(code: str) -> str
    class MyEnv(Environment):
        tools = [python]

    result = await run_python("print(2**10)", SandboxLimits(cpu_s=2, wall_s=5))   # SandboxResult

What confines the child (Linux; each step is best effort where the platform refuses it, see `applied`):
  - resource rlimits set before exec: CPU seconds (RLIMIT_CPU, then SIGKILL), address space
    (RLIMIT_AS: a huge allocation raises MemoryError), file size (RLIMIT_FSIZE), open files, no core
    dumps, and processes (RLIMIT_NPROC);
  - no network: a fresh network namespace (unshare(CLONE_NEWNET), only loopback, down), as root or
    through an unprivileged user namespace; where neither is allowed, an audit hook in the child
    refuses socket creation (best effort: Python code can be stopped that way, native code cannot);
  - when started as root the child drops to uid/gid 65534 (nobody), so RLIMIT_NPROC is enforced (the
    kernel ignores it for root), if nobody can run the interpreter (a Python under /root cannot: then
    the child stays root, `applied` lacks "nobody"; set `interpreter`, e.g. /usr/bin/python3); an
    audit hook refuses fork/exec/spawn from Python code in every case;
  - wall clock: the whole process group is killed at `wall_s`;
  - a fresh empty working directory, `python -I` (no user site, no PYTHONPATH), a minimal environment;
  - stdout+stderr are cut to `max_output_chars` (head and tail kept).

Invariants: `run_python` never raises for anything the code does (infinite loop, huge allocation, fork
bomb, network attempt, crash): it returns a SandboxResult whose `error` says what happened, within
about `wall_s` seconds, and leaves no process behind. Not a security boundary against a determined
attacker (no seccomp): it contains mistakes and runaway RL samples.

Run alone: `python -m pytest tests/test_sandbox.py -q`.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import resource
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Optional

CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
NOBODY = 65534

# Runs in the child before the user's code (read from stdin): refuse what the rlimits cannot stop.
PRELUDE = r"""
import sys
def _guard(event, args, _blocked=%(blocked)r):
    if event in _blocked or (event == "socket.__new__" and %(block_sockets)r):
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.addaudithook(_guard)
del _guard
"""
BLOCKED_EVENTS = ("os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                  "subprocess.Popen", "os.kill", "os.killpg", "ctypes.dlopen")


@dataclass
class SandboxLimits:
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU)
    wall_s: float = 10.0  # wall clock, then the process group is killed
    memory_mb: int = 512  # address space (RLIMIT_AS)
    file_mb: int = 16  # largest file the code may write (RLIMIT_FSIZE)
    max_processes: int = 64  # RLIMIT_NPROC for the sandbox user (enforced when not root)
    max_output_chars: int = 4000  # stdout+stderr beyond this is cut
    interpreter: str = ""  # the Python that runs the code; "" = this one (sys.executable)


@dataclass
class SandboxResult:
    output: str  # stdout and stderr interleaved, truncated
    returncode: Optional[int]
    error: Optional[str]  # None on success; "timeout", "cpu time limit", "exit code 1", ...
    applied: list = field(default_factory=list)  # which confinements took effect (for logs and tests)

    def observation(self) -> str:
        return self.output if self.error is None else f"error: {self.error}\n{self.output}".rstrip()


def _unshare_network() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) == 0:
        return True
    return os.geteuid() != 0 and libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0


def _world_executable(path: str) -> bool:
    """Whether uid nobody can run `path`: the file and every folder above it are o+x."""
    path = os.path.realpath(path)
    parts = [path] + [os.path.dirname(path)]
    while parts[-1] != os.path.dirname(parts[-1]):
        parts.append(os.path.dirname(parts[-1]))
    return all(os.stat(p).st_mode & 0o001 for p in parts)


def _confine(limits: SandboxLimits, workdir: str, report_fd: int, drop_user: bool) -> None:
    """Runs in the child between fork and exec (preexec_fn): namespaces, rlimits, user."""
    applied = []
    try:
        if _unshare_network():
            applied.append("netns")
    except OSError:
        pass
    cpu = limits.cpu_s
    for name, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (limits.memory_mb << 20,) * 2),
                        (resource.RLIMIT_FSIZE, (limits.file_mb << 20,) * 2), (resource.RLIMIT_CORE, (0, 0)),
                        (resource.RLIMIT_NOFILE, (64, 64)), (resource.RLIMIT_NPROC, (limits.max_processes,) * 2)):
        resource.setrlimit(name, value)
    applied.append("rlimits")
    if drop_user:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        applied.append("nobody")
    os.chdir(workdir)
    os.write(report_fd, ",".join(applied).encode())
    os.close(report_fd)


async def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` with `python -I` under the limits above -> SandboxResult (never raises for the code)."""
    workdir = tempfile.mkdtemp(prefix="nanoverl_sandbox_")
    interpreter = limits.interpreter or sys.executable
    drop_user = os.geteuid() == 0 and _world_executable(interpreter)
    if drop_user:
        os.chown(workdir, NOBODY, NOBODY)
    read_fd, write_fd = os.pipe()
    try:
        process = await asyncio.create_subprocess_exec(
            interpreter, "-I", "-", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True, pass_fds=(write_fd,), cwd="/",
            env={"PATH": "/usr/bin:/bin", "PYTHONIOENCODING": "utf-8"},
            preexec_fn=lambda: _confine(limits, workdir, write_fd, drop_user))
        os.close(write_fd)
        write_fd = -1
        applied = os.read(read_fd, 256).decode().split(",")
        prelude = PRELUDE % {"blocked": BLOCKED_EVENTS, "block_sockets": "netns" not in applied}
        return await _communicate(process, prelude + code, limits, applied)
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
        shutil.rmtree(workdir, ignore_errors=True)


async def _communicate(process, source: str, limits: SandboxLimits, applied: list) -> SandboxResult:
    async def read_all() -> bytes:
        process.stdin.write(source.encode())
        await process.stdin.drain()
        process.stdin.close()
        chunks, size = [], 0
        while chunk := await process.stdout.read(65536):
            if size < limits.max_output_chars * 4:  # keep reading (the child must not block), keep little
                chunks.append(chunk)
            size += len(chunk)
        await process.wait()
        return b"".join(chunks)

    error = None
    try:
        raw = await asyncio.wait_for(read_all(), limits.wall_s)
    except (asyncio.TimeoutError, BrokenPipeError, ConnectionResetError) as exc:
        raw, error = b"", "timeout" if isinstance(exc, asyncio.TimeoutError) else "the process closed its input"
    finally:
        _kill_group(process.pid)
        await process.wait()
    output = raw.decode("utf-8", errors="replace")
    if len(output) > limits.max_output_chars:  # keep the head and the tail (where the error is)
        half = limits.max_output_chars // 2
        output = f"{output[:half]}\n... ({len(output) - 2 * half} chars cut) ...\n{output[-half:]}"
    code = process.returncode
    if error is None and code != 0:
        error = "cpu time limit" if code in (-signal.SIGXCPU, -signal.SIGKILL) else (
            f"killed by signal {-code}" if code < 0 else f"exit code {code}")
    return SandboxResult(output, code, error, applied)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it prints (stdout and stderr).

    Args:
        code: a complete Python program; print the results you want to see.
    """
    return (await run_python(code)).observation()
