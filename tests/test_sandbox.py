"""The sandboxed Python tool: runaway code ends cleanly, fast, with an error observation."""

import asyncio
import os
import time

import pytest

from nanoverl_async.sandbox import SandboxLimits, python, run_python
from nanoverl_async.tools import as_tool, call_tool

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX only")
FAST = SandboxLimits(cpu_s=2, wall_s=4.0, memory_mb=256, max_output_chars=200)


def run(code, limits=FAST):
    started = time.monotonic()
    result = asyncio.run(run_python(code, limits))
    return result, time.monotonic() - started


def test_ordinary_code_and_output_truncation():
    result, _ = run("print(sum(range(10)))")
    assert (result.output, result.error, result.returncode) == ("45\n", None, 0)
    result, _ = run("print('x' * 10_000)")
    assert result.error is None and len(result.output) < 300 and "chars cut" in result.output
    result, _ = run("raise ValueError('nope')")
    assert result.error == "exit code 1" and "ValueError: nope" in result.observation()


def test_infinite_loop_hits_the_cpu_or_wall_limit():
    result, seconds = run("while True: pass", SandboxLimits(cpu_s=1, wall_s=3.0))
    assert result.error in ("cpu time limit", "timeout") and seconds < 5


def test_sleeping_forever_hits_the_wall_clock():
    result, seconds = run("import time; time.sleep(60)", SandboxLimits(cpu_s=2, wall_s=1.0))
    assert result.error == "timeout" and seconds < 3


def test_huge_allocation_fails_with_memory_error():
    result, seconds = run("x = bytearray(8 * 1024**3); print('allocated')")
    assert result.error == "exit code 1" and "MemoryError" in result.output and seconds < 6


def test_fork_bomb_is_refused():
    result, seconds = run("import os\nwhile True: os.fork()")
    assert result.error is not None and "allocated" not in result.output and seconds < 6
    result, _ = run("import subprocess; subprocess.run(['echo', 'hi'])")
    assert result.error == "exit code 1" and "not allowed" in result.output


def test_network_is_unreachable():
    result, seconds = run("import socket; socket.create_connection(('1.1.1.1', 80), timeout=2); print('connected')")
    assert result.error == "exit code 1" and "connected" not in result.output and seconds < 6
    assert "netns" in result.applied or "not allowed" in result.output


def test_as_a_tool_the_failure_is_an_observation():
    tool = as_tool(python)
    assert tool.schema["function"]["parameters"]["required"] == ["code"]
    result = asyncio.run(call_tool(tool, {"code": "print(6*7)"}, timeout_s=20))
    assert (result.text, result.error) == ("42\n", False)
    result = asyncio.run(call_tool(tool, {"code": "1/0"}, timeout_s=20))
    assert not result.error and result.text.startswith("error: exit code 1") and "ZeroDivisionError" in result.text


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"), reason="needs root and a system Python")
def test_as_root_with_a_world_readable_python_the_code_runs_as_nobody():
    limits = SandboxLimits(cpu_s=2, wall_s=4.0, interpreter="/usr/bin/python3", max_processes=8)
    result, seconds = run("import os; print(os.getuid())", limits)
    assert "nobody" in result.applied and result.output == "65534\n"
    result, seconds = run("import os\nwhile True: os.fork()", limits)
    assert result.error is not None and seconds < 6
