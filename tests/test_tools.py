"""Tools (schema from signature and docstring, argument checks, timeouts, errors) and call parsers."""

import asyncio
import contextlib
import threading
import time
from typing import Literal, Optional

import pytest

from nanoverl_async.agents.tool_parsers import parse_builtin, parse_hermes
from nanoverl_async.agents.tools import CANCEL_GRACE_S, ToolResult, as_tool, call_tool, check_arguments


def search(query: str, limit: int = 5, mode: Literal["fast", "exact"] = "fast", tags: Optional[list[str]] = None,
           weight: float = 1.0) -> str:
    """Search the notes.

    Longer explanation that is not part of the description.

    Args:
        query: what to look for,
            possibly over two lines.
        limit (int): how many results.
        mode: search mode.
    """
    return f"{query}:{limit}:{mode}:{tags}:{weight}"


async def slow(seconds: float) -> str:
    """Sleep."""
    await asyncio.sleep(seconds)
    return "done"


def slow_blocking(seconds: float) -> str:
    """Sleep, holding the thread (as a `requests` call does)."""
    time.sleep(seconds)
    return "done"


def boom(x: int) -> int:
    """Fail."""
    raise RuntimeError("kaput")


def run(coroutine):
    return asyncio.run(coroutine)


def test_schema_from_signature_and_docstring():
    tool = as_tool(search)
    function = tool.schema["function"]
    assert function["name"] == "search" and function["description"] == "Search the notes."
    props = function["parameters"]["properties"]
    assert props["query"] == {"type": "string", "description": "what to look for, possibly over two lines."}
    assert props["limit"] == {"type": "integer", "description": "how many results."}
    assert props["mode"]["enum"] == ["fast", "exact"]
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert props["weight"] == {"type": "number"}
    assert function["parameters"]["required"] == ["query"]
    assert as_tool(tool) is tool and as_tool(slow, name="wait").name == "wait"


def no_doc(x: int) -> int:
    return x


def half_typed(x: int, y) -> int:
    """Add."""


def unresolved(x: "Missing") -> int:  # noqa: F821 - the name is missing on purpose
    """Add."""


def now() -> str:
    """The time: no parameters, so no hints needed."""


def echo(text: str, *rest, **options):
    """Echo; a return hint and hints on *rest, **options (not in the schema) are not needed."""


@pytest.mark.parametrize("fn,problem", [
    (no_doc, "tool 'no_doc' needs a docstring:"),
    (half_typed, "tool 'half_typed' needs a type hint on y:"),
    (lambda x: x, "tool '<lambda>' needs a type hint on x and a docstring:"),
    (unresolved, "tool 'unresolved': its type hints do not resolve (NameError"),
    ("calc", "tool 'calc' is a str, not a function"),
])
def test_a_tool_the_model_could_only_guess_how_to_call_is_refused(fn, problem):
    with pytest.raises(ValueError) as raised:
        as_tool(fn)
    assert str(raised.value).startswith(problem), raised.value
    assert as_tool(now).parameters == [] and as_tool(echo).parameters == ["text"]


class Scaler:
    def __init__(self, factor: int):
        self.factor = factor

    def scale(self, x: int) -> int:
        """Multiply x by this scaler's factor.

        Args:
            x: the number.
        """
        return x * self.factor


def test_a_methods_schema_is_read_once_and_each_tool_calls_its_own_instance():
    """Every episode's environment declares its tools again: the schema is built once, the instance is each's."""
    two, three = as_tool(Scaler(2).scale), as_tool(Scaler(3).scale)
    assert two.schema is three.schema
    assert two.schema["function"]["parameters"] == {"type": "object", "properties": {
        "x": {"type": "integer", "description": "the number."}}, "required": ["x"]}  # no `self`
    assert (two.fn(x=5), three.fn(x=5)) == (10, 15)
    assert as_tool(Scaler(2).scale, name="times").schema["function"]["name"] == "times"


@pytest.mark.parametrize("arguments,problem", [
    ({"query": "a"}, None),
    ({"query": "a", "limit": 3, "weight": 2, "tags": ["x"], "mode": "exact"}, None),  # int is fine for float
    ({}, "missing argument 'query'"),
    ({"query": "a", "nope": 1}, "unknown argument 'nope'"),
    ({"query": 3}, "argument 'query' of search must be string"),
    ({"query": "a", "limit": True}, "argument 'limit' of search must be integer"),  # bool is not int
    ({"query": "a", "limit": 2.5}, "must be integer"),
    ({"query": "a", "mode": "slow"}, "argument 'mode'"),
    ({"query": "a", "tags": ["x", 1]}, "argument 'tags'"),
    ([1, 2], "arguments must be an object"),
])
def test_argument_checks(arguments, problem):
    found = check_arguments(as_tool(search), arguments)
    assert found == problem if problem is None else problem in found


def test_call_results_and_errors():
    ok = run(call_tool(as_tool(search), {"query": "a"}))
    assert (ok.text, ok.error) == ("a:5:fast:None:1.0", False)
    bad = run(call_tool(as_tool(search), {"query": 1}))
    assert bad.error and bad.text.startswith("error: argument 'query'")
    raised = run(call_tool(as_tool(boom), {"x": 1}))
    assert (raised.text, raised.error) == ("error: kaput", True)
    started = time.perf_counter()
    timed_out = run(call_tool(as_tool(slow), {"seconds": 5}, timeout_s=0.05))
    assert (timed_out.text, timed_out.error) == ("error: timeout after 0.05s", True)
    assert time.perf_counter() - started < 5  # at the timeout, not when the 5 s tool ended
    own_limit = run(call_tool(as_tool(slow, timeout_s=0.02), {"seconds": 5}, timeout_s=10))
    assert own_limit.text == "error: timeout after 0.02s"
    assert run(call_tool(as_tool(search), {"query": "x" * 100}, max_chars=10)).text == "x" * 10


def test_a_blocking_tool_that_never_returns_holds_neither_the_call_nor_its_loop():
    release = threading.Event()

    def stuck() -> str:
        """Blocks until the test ends."""
        release.wait()
        return "late"

    outcome = []  # asyncio.run's result: the loop has closed too (asyncio.to_thread's pool was joined there)
    caller = threading.Thread(target=lambda: outcome.append(run(call_tool(as_tool(stuck), {}, timeout_s=0.2))))
    started = time.monotonic()
    caller.start()
    caller.join(3)
    seconds, returned_while_stuck = time.monotonic() - started, not caller.is_alive()
    release.set()
    caller.join()
    # at its timeout, not before, and while the tool was still stuck (never on a loaded machine's wall clock)
    assert outcome == [ToolResult("error: timeout after 0.2s", True)] and returned_while_stuck and seconds >= 0.2


def test_an_async_tool_that_swallows_its_cancellation_is_left_behind_after_the_grace():
    async def call() -> tuple:
        release = asyncio.Event()

        async def stubborn() -> str:
            """Runs until the test ends, whatever cancels it."""
            while not release.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await release.wait()
            return "late"

        calling = asyncio.ensure_future(call_tool(as_tool(stubborn), {}, timeout_s=0.2))
        started = time.monotonic()
        await asyncio.wait({calling}, timeout=3)
        seconds, returned_while_running = time.monotonic() - started, calling.done()
        release.set()
        return await calling, seconds, returned_while_running

    result, seconds, returned_while_running = run(call())
    assert result == ToolResult("error: timeout after 0.2s", True)
    # after the timeout and the whole grace, and while the tool still ran: left behind, not waited for
    assert returned_while_running and seconds >= 0.2 + CANCEL_GRACE_S, seconds


@pytest.mark.parametrize("fn", [slow, slow_blocking])
def test_the_calls_of_64_concurrent_episodes_overlap(fn):
    """As the episodes of one generator make them, on one loop: each call takes 2 s, all 64 together about as
    long, and none waits for a thread past its timeout (asyncio.to_thread's pool has min(32, CPUs + 4))."""
    async def episodes() -> list:
        return await asyncio.gather(*(call_tool(as_tool(fn), {"seconds": 2.0}, timeout_s=5.0) for _ in range(64)))

    started = time.monotonic()
    results = run(episodes())
    seconds = time.monotonic() - started
    # one wave: calls queued for a thread would take a second wave, 2 s more (the bound leaves 2 s for a loaded machine)
    assert results == [ToolResult("done", False)] * 64 and 2.0 <= seconds < 4.0, seconds


def test_hermes_parser():
    text = ('Let me look.\n<tool_call>\n{"name": "search", "arguments": {"query": "a"}}\n</tool_call>\n'
            '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"b\\"}"}</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me look."
    assert [(c.name, c.arguments, c.error) for c in calls] == [("search", {"query": "a"}, None),
                                                               ("search", {"query": "b"}, None)]
    assert parse_hermes("just an answer") == ("just an answer", [])
    broken = {
        "<tool_call>{not json}</tool_call>": "invalid JSON",
        '<tool_call>{"arguments": {}}</tool_call>': "expected",
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>': "must be a JSON object",
        '<tool_call>{"name": "f", "arguments": {}': "without </tool_call>",
    }
    for text, why in broken.items():
        _, calls = parse_hermes(text)
        assert len(calls) == 1 and why in calls[0].error, text


def test_builtin_parser():
    assert parse_builtin("hi <call>2*3</call>", "calc", "expression")[1][0].arguments == {"expression": "2*3"}
    assert parse_builtin("12</call>", "calc", "e")[1][0].error == "malformed call"
    assert parse_builtin("<call> </call>", "calc", "e")[1][0].error == "malformed call"
    assert parse_builtin("6", "calc", "e") == ("6", [])


def test_a_finished_tool_thread_takes_the_next_call_instead_of_a_new_thread():
    ran_on = []

    def square(x: int) -> int:
        """Square x.

        Args:
            x: a number.
        """
        ran_on.append(threading.current_thread())
        return x * x

    tool = as_tool(square)

    async def one_after_another() -> list[str]:  # the thread of the call before is idle again each time
        return [(await call_tool(tool, {"x": x})).text for x in range(20)]

    async def calls() -> tuple[set, list[str]]:
        await call_tool(tool, {"x": 0})  # at least one tool thread exists, idle once this returns
        return set(threading.enumerate()), await one_after_another()

    alive_before, results = asyncio.run(calls())
    assert results == [str(x * x) for x in range(20)]
    assert len(ran_on) == 21 and set(ran_on[1:]) <= alive_before  # no call started a thread
    assert all(thread.daemon and thread is not threading.main_thread() for thread in ran_on)
