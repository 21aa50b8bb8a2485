"""The sandboxed Python tool: ordinary code runs; every escape a probe tried fails; each limit stops the code
by its own reason, near the value it names; without bubblewrap the tool refuses unless the user opts out.

The isolation tests need bubblewrap (CI installs it, .ci/run); where it is not installed they skip, saying
what to install (`pytest -rs` shows it). Each escape test also empties an in-process guard first (an audit
hook, as the sandbox once had) and then goes through libc, so only the operating system's isolation can stop it.
"""

import asyncio
import os
import shutil
import signal
import socket
import sys
import threading
import time
import uuid

import pytest

from nanoverl_async.agents import sandbox
from nanoverl_async.agents.sandbox import SandboxLimits, SandboxUnavailable, python, run_python
from nanoverl_async.agents.tools import as_tool, call_tool

FAST = SandboxLimits(cpu_s=2, wall_s=10.0, memory_mb=256, max_output_chars=400)
UNSAFE = "unsafe_no_isolation"
# Disables an in-process guard such as an audit hook that refuses fork/exec (the hook cannot be removed,
# but its function can be found and emptied); then uses libc directly, which no Python hook sees.
DISABLE_GUARD = """
import gc, os
for f in gc.get_objects():
    if type(f).__name__ == "function" and f.__name__.startswith("_guard") and f.__defaults__:
        f.__defaults__ = tuple(() if isinstance(d, tuple) else False for d in f.__defaults__)
import ctypes
libc = ctypes.CDLL(None)
"""

# Skipped only where bubblewrap is not installed: installed but unable to isolate, these tests fail, loudly.
isolated = pytest.mark.skipif(shutil.which(sandbox.BWRAP) is None, reason=(
    f"the sandbox's isolation tests need bubblewrap, and {sandbox.BWRAP} is not on PATH: install it "
    f"(apt-get install bubblewrap, as .ci/run does)"))
BOTH = [pytest.param("bwrap", marks=isolated), UNSAFE]


def run(code, limits=FAST):
    """run_python -> (its result, seconds); a call still running 5 s past its wall clock fails the test."""
    started = time.monotonic()
    result = asyncio.run(asyncio.wait_for(run_python(code, limits), limits.wall_s + 5))
    return result, time.monotonic() - started


@isolated
def test_ordinary_code_and_output_truncation():
    result, _ = run("print(sum(range(10)))")
    assert (result.output, result.error, result.returncode, result.isolation) == ("45\n", None, 0, "bwrap")
    result, _ = run("print('x' * 10_000)")
    assert result.error is None and len(result.output) < 500 and "chars cut" in result.output
    result, _ = run("raise ValueError('nope')")
    assert result.error == "exit code 1" and "ValueError: nope" in result.observation()
    result, _ = run("import numpy, os; print(numpy.arange(4).sum(), os.getcwd())")  # the venv's packages
    assert (result.output, result.error) == ("6 /tmp\n", None)
    result, _ = run("print(callable(help)); exit(3)")  # the builtins site adds, though the interpreter skips it (-S)
    assert (result.output, result.error) == ("True\n", "exit code 3")


@isolated
def test_code_that_disables_the_guard_and_forks_through_libc_runs_as_nobody_never_root():
    code = DISABLE_GUARD + """
libc.system(b"id -u; id -g; id -G")                               # fork + exec /bin/sh through libc
pid = os.posix_spawn("/bin/sh", ["sh", "-c", "id -u"], {})
os.waitpid(pid, 0)
if libc.fork() == 0:
    os.execv("/bin/sh", ["sh", "-c", "id -u"])
os.wait()
"""
    result, _ = run(code)
    assert result.error is None and result.output.split() == ["65534"] * 5, result.output


@isolated
def test_root_only_files_and_the_home_are_not_visible():
    secret = os.path.join(os.path.expanduser("~"), f".nanoverl_sandbox_secret_{uuid.uuid4().hex}")
    with open(secret, "w") as file:
        file.write("the user's secret")
    try:
        for path in ("/etc/shadow", secret):
            result, _ = run(DISABLE_GUARD + f"print(open({path!r}).read())")
            assert result.error == "exit code 1" and "FileNotFoundError" in result.output, result.output  # not there
            assert "the user's secret" not in result.output and "root:" not in result.output
        result, _ = run(f"import os; print(os.listdir({os.path.dirname(secret)!r}))")
        assert os.path.basename(secret) not in result.output
    finally:
        os.remove(secret)


@isolated
def test_writing_anywhere_but_tmp_fails():
    here = os.path.dirname(os.path.abspath(__file__))
    targets = ["/", here, os.path.expanduser("~"), "/root", "/work", "/usr/lib", sys.prefix]
    name = f"nanoverl_sandbox_{uuid.uuid4().hex}"
    code = DISABLE_GUARD + f"""
for folder in {targets!r}:
    try:
        open(os.path.join(folder, {name!r}), "w").write("x")
        print("wrote", folder)
    except OSError as error:
        print("refused", type(error).__name__)
open({name!r}, "w").write("x")                     # the working directory, a private /tmp
print("cwd", os.getcwd(), sorted(os.listdir(".")))
"""
    result, _ = run(code)
    assert result.error is None and "wrote" not in result.output, result.output
    # /tmp holds the file alone, beside the folder of an interpreter that lives under /tmp (a venv in a checkout
    # there), bound read-only above the private /tmp
    under_tmp = sorted({p.split("/")[2] for p in {sys.prefix, sys.base_prefix} if p.startswith("/tmp/")})
    assert result.output.count("refused") == len(targets)
    assert f"cwd /tmp {sorted([name, *under_tmp])}" in result.output, result.output
    assert not any(os.path.exists(os.path.join(folder, name)) for folder in targets + ["/tmp"])


@isolated
def test_root_in_a_nested_user_namespace_cannot_unlock_the_mounts():
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
uid = os.getuid()
assert libc.unshare(0x10000000 | 0x00020000) == 0  # CLONE_NEWUSER | CLONE_NEWNS
open("/proc/self/setgroups", "w").write("deny")
open("/proc/self/uid_map", "w").write(f"0 {uid} 1")
MS_REMOUNT, MS_BIND = 32, 4096
print(os.getuid(), [libc.mount(None, path, None, MS_REMOUNT | MS_BIND, None) for path in (b"/", b"/usr")],
      libc.umount2(b"/usr", 2))
try:
    open("/usr/nanoverl_sandbox_probe", "w")
except OSError as error:
    print(type(error).__name__, error.errno)
"""
    result, _ = run(code)
    assert result.output == "0 [-1, -1] -1\nOSError 30\n", result.output  # EROFS


def _processes_with(marker: str) -> list:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if marker.encode() in cmdline.read():
                    found.append(pid)
        except OSError:  # it ended while we looked
            pass
    return found


@isolated
def test_no_process_outlives_the_call():
    marker = f"30.{uuid.uuid4().int % 10**8}"  # sleep's argument: a process only this test starts
    code = DISABLE_GUARD + f"""
if libc.fork() == 0:          # double fork into a new session, as a daemon does
    os.setsid()
    if libc.fork() == 0:
        os.execv("/bin/sleep", ["sleep", "{marker}"])
    os._exit(0)
os.wait()
print("spawned", flush=True)
"""
    result, seconds = run(code)
    assert result.error is None and "spawned" in result.output and seconds < FAST.wall_s
    time.sleep(1.0)
    assert _processes_with(marker) == []
    result, seconds = run(code + "import time\ntime.sleep(60)\n", SandboxLimits(cpu_s=2, wall_s=2.0))
    assert result.error == "wall time limit" and seconds < 4  # killed at the wall clock: its descendants with it
    time.sleep(1.0)
    assert _processes_with(marker) == []
    # the episode's tool timeout (agent.tool_timeout_s) may come first: cancelling the call kills it too
    result = asyncio.run(call_tool(as_tool(python), {"code": code + "import time\ntime.sleep(60)\n"}, timeout_s=1.5))
    assert result.error and result.text == "error: timeout after 1.5s"
    time.sleep(1.0)
    assert _processes_with(marker) == []


@isolated
def test_sockets_reach_neither_a_host_port_nor_an_outside_address():
    server = socket.create_server(("127.0.0.1", 0))
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(f"\0nanoverl-sandbox-{uuid.uuid4().hex}")
    abstract.listen()
    accepted = []

    def accept() -> None:
        server.settimeout(8)
        try:
            accepted.append(server.accept())
        except OSError:
            pass
    thread = threading.Thread(target=accept)
    thread.start()
    port, address = server.getsockname()[1], abstract.getsockname()
    code = DISABLE_GUARD + f"""
import socket
for family, target in ((socket.AF_INET, ("127.0.0.1", {port})), (socket.AF_INET, ("1.1.1.1", 53)),
                       (socket.AF_INET, ("8.8.8.8", 443)), (socket.AF_UNIX, {address!r})):
    try:
        socket.socket(family).connect(target) if family == socket.AF_UNIX else socket.create_connection(target, timeout=2)
        print("connected", target)
    except OSError as error:
        print("refused", type(error).__name__)
"""
    try:
        result, _ = run(code)
    finally:
        server.close()
        abstract.close()
        thread.join()
    assert "connected" not in result.output and result.output.count("refused") == 4, result.output
    assert accepted == []


# Prints its own CPU time every 0.02 s: the last line printed is where the kernel stopped it.
CPU_LOOP = """import signal, time
if IGNORE_SIGXCPU:
    signal.signal(signal.SIGXCPU, signal.SIG_IGN)
mark = 0.0
while True:
    if time.process_time() >= mark:
        print(f"{time.process_time():.3f}", flush=True)
        mark += 0.02
"""


@isolated
@pytest.mark.parametrize("cpu_s,ignore", [(1, False), (2, False), (1, True)])
def test_a_busy_loop_is_stopped_by_the_cpu_limit_it_names(cpu_s, ignore):
    """SIGXCPU at cpu_s; code that ignores it is killed at the hard limit, cpu_s + 1; never the wall clock."""
    # the wall clock far off: on a loaded machine the loop may get a tenth of a core, yet it must reach its CPU limit
    limits = SandboxLimits(cpu_s=cpu_s, wall_s=60.0, max_output_chars=100_000)
    result, seconds = run(f"IGNORE_SIGXCPU = {ignore}\n" + CPU_LOOP, limits)
    stopped_at, signum = (cpu_s + 1, signal.SIGKILL) if ignore else (cpu_s, signal.SIGXCPU)
    assert result.error == "cpu time limit" and seconds < limits.wall_s, (result.error, seconds)
    # which limit fired, by its signal (bwrap reports signal s as exit code 128 + s): the soft one, or the hard one
    assert result.returncode == 128 + signum, result.returncode
    # Where: the kernel charges CPU time for its limits a whole tick to whichever process the tick finds running,
    # so on a loaded machine it stops the loop up to tenths of a second from the loop's own precise clock (1.80
    # for a limit of 2 with six busy processes on two cores). Half a second still tells apart every pair of
    # limits compared here (1 and 2 s, soft and hard).
    assert abs(float(result.output.split()[-1]) - stopped_at) < 0.5, result.output[-60:]


@isolated
def test_the_memory_limit_is_the_address_space_it_names():
    limits = SandboxLimits(cpu_s=5, wall_s=20.0, memory_mb=256)
    result, _ = run("x = bytearray(160 * 2**20); print('allocated')", limits)  # under 256 MB with the interpreter
    assert (result.output, result.error) == ("allocated\n", None)
    result, _ = run("x = bytearray(256 * 2**20); print('allocated')", limits)  # the limit itself: over it
    assert result.error == "exit code 1" and "MemoryError" in result.output and "allocated" not in result.output


@pytest.mark.parametrize("isolation", BOTH)
def test_the_rlimits_inside_are_exactly_the_configured_ones(isolation):
    limits = SandboxLimits(cpu_s=3, memory_mb=300, file_mb=7, max_processes=9, isolation=isolation)
    code = """import resource
for name in ("CPU", "AS", "FSIZE", "NPROC", "NOFILE", "CORE"):
    print(name, *resource.getrlimit(getattr(resource, "RLIMIT_" + name)))
"""
    result, _ = run(code, limits)
    assert result.output == ("CPU 3 4\nAS 314572800 314572800\nFSIZE 7340032 7340032\nNPROC 9 9\nNOFILE 64 64\n"
                             "CORE 0 0\n"), result.output


@isolated
def test_a_fork_bomb_stops_at_the_process_limit_and_leaves_nothing():
    code = DISABLE_GUARD + """
import time
children = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(20.123)
            os._exit(0)
        children += 1
except OSError as error:
    print(children, type(error).__name__)
"""
    result, seconds = run(code, SandboxLimits(cpu_s=2, wall_s=10.0, max_processes=8))
    # RLIMIT_NPROC counts uid 65534's processes in the sandbox's user namespace: the interpreter and its
    # children (and bwrap's PID 1 when we are not root: it runs as the same user there)
    children = 8 - 1 - (os.geteuid() != 0)
    assert result.error is None and result.output == f"{children} BlockingIOError\n", result.output
    time.sleep(1.0)
    assert _processes_with("20.123") == [] and seconds < 10


@isolated
def test_files_are_capped_by_size():
    result, _ = run("open('big', 'wb').write(b'x' * (2 * 2**20))", SandboxLimits(file_mb=1, wall_s=10.0))
    assert result.error == "exit code 1" and "File too large" in result.output


def test_without_bubblewrap_the_tool_refuses_in_one_line_unless_the_user_opts_out(monkeypatch):
    monkeypatch.setattr(sandbox, "BWRAP", "/nonexistent/bwrap")
    sandbox._bwrap.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable) as refused:
            run("print(1)")
        assert str(refused.value) == sandbox.refusal("bubblewrap (/nonexistent/bwrap) is not installed")
        assert "\n" not in str(refused.value) and "apt-get install bubblewrap" in str(refused.value)
        assert "agent.sandbox=unsafe_no_isolation" in str(refused.value)
        result = asyncio.run(call_tool(as_tool(python), {"code": "print(1)"}, timeout_s=20))
        assert result.error and "apt-get install bubblewrap" in result.text
        unsafe = SandboxLimits(cpu_s=1, wall_s=10.0, isolation=UNSAFE)
        result, _ = run("print(sum(range(10)))", unsafe)
        assert (result.output, result.error, result.isolation) == ("45\n", None, UNSAFE)
        result, seconds = run("while True: pass", unsafe)  # the rlimits still hold
        assert result.error == "cpu time limit" and seconds < 10
        monkeypatch.setattr(sandbox, "TOOL_LIMITS", sandbox.TOOL_LIMITS)
        sandbox.set_isolation(UNSAFE)  # what agent.sandbox=unsafe_no_isolation does in a generator
        result = asyncio.run(call_tool(as_tool(python), {"code": "print(6*7)"}, timeout_s=20))
        assert (result.text, result.error) == ("42\n", False)
        with pytest.raises(ValueError, match="unsafe_no_isolation"):
            sandbox.set_isolation("none")
    finally:
        sandbox._bwrap.cache_clear()


def test_an_env_with_the_python_tool_is_refused_at_start_without_bubblewrap(monkeypatch, tmp_path):
    from nanoverl_async.config import ConfigError, load_config
    from nanoverl_async.controller.preflight import prepare
    (tmp_path / "coder.py").write_text("from nanoverl_async import Environment, python\n\n"
                                       "class Coder(Environment):\n    tools = [python]\n")
    config = ["configs/agent_grpo.yaml", [f"agent.env={tmp_path / 'coder.py'}:Coder"]]
    monkeypatch.setattr(sandbox, "BWRAP", "/nonexistent/bwrap")
    sandbox._bwrap.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"^config key 'agent\.sandbox': sandbox: bubblewrap .* is not "
                                              r"installed; install bubblewrap"):
            prepare(load_config(*config))
        prepare(load_config(config[0], config[1] + ["agent.sandbox=unsafe_no_isolation"]))  # the user's choice
        prepare(load_config("configs/agent_grpo.yaml"))  # an env without the python tool needs no sandbox
    finally:
        sandbox._bwrap.cache_clear()


def test_where_bubblewrap_cannot_isolate_the_refusal_quotes_it(monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"  # as bwrap fails where user namespaces are blocked
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox, "BWRAP", str(fake))
    sandbox._bwrap.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable) as refused:
            run("print(1)")
        why = "bubblewrap cannot isolate here (bwrap: No permissions to create new namespace)"
        assert str(refused.value) == sandbox.refusal(why)
    finally:
        sandbox._bwrap.cache_clear()


@isolated
def test_sleeping_forever_hits_the_wall_clock():
    result, seconds = run("import time; time.sleep(60)", SandboxLimits(cpu_s=2, wall_s=1.0))
    assert result.error == "wall time limit" and seconds < 3


ENDLESS = "while True:\n    print('x' * 65536, end='')"


@pytest.mark.parametrize("isolation", BOTH)
@pytest.mark.parametrize("writer", ["the program", "a child in a session of its own"])
def test_output_without_end_is_stopped_by_the_wall_clock(isolation, writer):
    """The code still prints when the wall clock comes: the call returns by it all the same, with the output's
    head. Unisolated, a child that left the process group outlives the kill: the output is given up on
    KILL_GRACE_S later, and the child's next write into the closed pipe ends it."""
    marker = f"# {uuid.uuid4().hex}"  # in the child's command line
    code = ENDLESS if writer == "the program" else f"""import os, sys, time
if os.fork() == 0:
    os.setsid()
    os.execv(sys.executable, [sys.executable, "-c", {ENDLESS + marker!r}])
time.sleep(60)
"""
    limits = SandboxLimits(cpu_s=10, wall_s=2.0, max_output_chars=400, isolation=isolation)
    result, seconds = run(code, limits)
    assert result.error == "wall time limit" and 2.0 <= seconds < 3.0, (result.error, seconds)
    # 4 bytes kept per character allowed (utf-8's most), then cut to the head and the tail of what was kept
    assert result.output == "x" * 200 + "\n... (1200 chars cut) ...\n" + "x" * 200
    time.sleep(1.0)
    assert _processes_with(marker) == []


@isolated
def test_as_a_tool_the_failure_is_an_observation():
    tool = as_tool(python)
    assert tool.schema["function"]["parameters"]["required"] == ["code"]
    result = asyncio.run(call_tool(tool, {"code": "print(6*7)"}, timeout_s=20))
    assert (result.text, result.error) == ("42\n", False)
    result = asyncio.run(call_tool(tool, {"code": "1/0"}, timeout_s=20))
    assert not result.error and result.text.startswith("error: exit code 1") and "ZeroDivisionError" in result.text
