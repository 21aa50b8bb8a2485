"""Tools: typed Python functions (sync or async) the model may call, with schemas from their signatures.

    def calculator(expression: str) -> str:
        '''Evaluate one arithmetic operation.

        Args:
            expression: "A*B" with non-negative integers, e.g. "12*34".
        '''

    tool = as_tool(calculator)          # Tool(name="calculator", schema={...}, ...)
    result = await call_tool(tool, {"expression": "12*34"})   # ToolResult("408", error=False)

The schema is OpenAI/Hermes function format, `{"type": "function", "function": {"name", "description",
"parameters": JSON schema}}`, built from the type hints (str, int, float, bool, list[...], dict, Literal,
Optional) and the Google-style docstring ("Args:" section; the first paragraph is the description).
A function without a docstring, or with a parameter without a type hint, is refused (ValueError naming
it): env.env_factory builds every declared tool when the run starts, so that is a config error then.

Invariants: `call_tool` never raises (except cancellation): unknown arguments, missing or wrongly typed
arguments, a raising tool and a timeout each come back as `ToolResult(text="error: ...", error=True)`,
cut to `max_chars`. Ints are accepted for float parameters; bools are not ints. A timeout ends the call
within `timeout_s` + CANCEL_GRACE_S whatever the tool does: an async tool is cancelled (and not waited
for past the grace if it ignores that); a synchronous tool runs on a daemon thread no other call holds, so the event
loop (and the other episodes) keep going, the calls of many episodes overlap instead of queueing for a small
pool, and the timeout counts the call's own run time. Python cannot kill that thread: after a timeout it runs
on, unwatched (a daemon, it does not keep the process alive at exit), so code that may run away belongs in
`nanoverl_async.agents.sandbox` (a killable subprocess).

Run alone: `python -m pytest tests/test_tools.py -q`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from nanoverl_async.agents.threads import in_thread

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}
CANCEL_GRACE_S = 0.5  # after a timeout, how long a cancelled tool may take to clean up (the sandbox's kill)


@dataclass
class Tool:
    """A callable with its name, JSON schema and limits. Build with `as_tool(fn)`."""

    fn: Callable[..., Any]  # sync or async; returns anything str() can render
    name: str
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}
    timeout_s: Optional[float] = None  # None: the episode's agent.tool_timeout_s
    hints: dict = field(default_factory=dict)  # parameter -> resolved type hint, for argument checks

    @property
    def parameters(self) -> list[str]:
        return list(self.schema["function"]["parameters"]["properties"])


@dataclass
class ToolResult:
    text: str  # the observation shown to the model
    error: bool  # True for every failure (counted in tool_errors)


def as_tool(fn: Callable | Tool, name: Optional[str] = None, timeout_s: Optional[float] = None) -> Tool:
    """A function (or a Tool, returned as is) -> Tool with a schema from its signature and docstring."""
    if isinstance(fn, Tool):
        return fn
    if not callable(fn):
        raise ValueError(f"tool {fn!r:.40} is a {type(fn).__name__}, not a function")
    name = name or fn.__name__
    schema, hints = _described(getattr(fn, "__func__", fn), inspect.ismethod(fn), name)
    return Tool(fn=fn, name=name, schema=schema, timeout_s=timeout_s, hints=hints)


@functools.lru_cache(maxsize=1024)
def _described(function: Callable, bound: bool, name: str) -> tuple[dict, dict]:
    """(schema, hints) of `function` as tool `name` (`bound`: a method, whose first parameter its instance
    fills). Cached: every episode's environment declares its tools again (a bound method is new each time),
    and reading a signature and docstring each time showed in a generator's time
    (docs/benchmarks.md "Costs behind choices in the code"). The schema is shared: read it, never change it."""
    try:
        hints = typing.get_type_hints(function)
    except Exception as error:  # noqa: BLE001 - e.g. a NameError from a hint naming an unimported type
        raise ValueError(f"tool '{name}': its type hints do not resolve ({type(error).__name__}: {error})") from None
    params = [p for p in list(inspect.signature(function).parameters.values())[bound:]
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    # The model sees only the schema: without a description or types it can but guess how to call the tool.
    untyped, doc = [p.name for p in params if p.name not in hints], inspect.getdoc(function) or ""
    missing = ([f"a type hint on {', '.join(untyped)}"] if untyped else []) + ([] if doc else ["a docstring"])
    if missing:
        raise ValueError(f"tool '{name}' needs {' and '.join(missing)}: its JSON schema, all the model "
                         f"sees of it, is built from them (nanoverl_async/agents/tools.py)")
    description, arg_docs = parse_docstring(doc)
    described = {arg: {"description": text} for arg, text in arg_docs.items()}
    properties = {p.name: {**json_schema(hints[p.name]), **described.get(p.name, {})} for p in params}
    required = [p.name for p in params if p.default is inspect.Parameter.empty]
    schema = {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}
    return schema, {p: hints[p] for p in properties}


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Google-style docstring -> (first paragraph, {arg: description}) from its "Args:" section."""
    description = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    args: dict[str, str] = {}
    current = None  # the argument a continuation line belongs to
    section = re.search(r"^(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?|\s*\n)+)", doc, flags=re.M)
    for line in section.group(1).splitlines() if section else ():
        match = re.match(r"^\s+(\w+)\s*(?:\([^)]*\))?:\s*(.*)$", line)
        if match:
            current = match.group(1)
            args[current] = match.group(2).strip()
        elif current and line.strip():
            args[current] += " " + line.strip()
    return description, args


def json_schema(hint: Any) -> dict:
    """A type hint -> JSON schema (str, int, float, bool, list[T], dict, Literal, Optional[T])."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        options = [a for a in args if a is not type(None)]
        return json_schema(options[0]) if len(options) == 1 else {"anyOf": [json_schema(a) for a in options]}
    if origin in (list, tuple, set):
        return {"type": "array", **({"items": json_schema(args[0])} if args else {})}
    if origin is dict:
        return {"type": "object"}
    return {}  # Any or an unknown type: no constraint


def check_value(hint: Any, value: Any) -> bool:
    """Whether a JSON value fits a type hint (the same subset as json_schema)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (int, float):  # an int fits a float; a bool fits neither
        return isinstance(value, int if hint is int else (int, float)) and not isinstance(value, bool)
    if hint in _JSON_TYPES:
        return isinstance(value, hint)
    if origin is typing.Literal:
        return value in args
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        return any(value is None if a is type(None) else check_value(a, value) for a in args)
    if origin in (list, tuple, set):
        return isinstance(value, list) and (not args or all(check_value(args[0], v) for v in value))
    if origin is dict:
        return isinstance(value, dict)
    return True


def check_arguments(tool: Tool, arguments: Any) -> Optional[str]:
    """None if `arguments` fit the tool's signature, else a short error naming the argument."""
    if not isinstance(arguments, dict):
        return f"arguments must be an object, got {type(arguments).__name__}"
    unknown = sorted(set(arguments) - set(tool.parameters))
    if unknown:
        return f"unknown argument '{unknown[0]}' for {tool.name}"
    for name in tool.schema["function"]["parameters"]["required"]:
        if name not in arguments:
            return f"missing argument '{name}' for {tool.name}"
    for name, value in arguments.items():
        if not check_value(tool.hints[name], value):
            expected = json_schema(tool.hints[name]).get("type", "a valid value")
            return f"argument '{name}' of {tool.name} must be {expected}, got {type(value).__name__}"
    return None


async def call_tool(tool: Tool, arguments: Any, timeout_s: float = 5.0, max_chars: int = 2000) -> ToolResult:
    """Check the arguments, run the tool with a timeout -> ToolResult. Never raises (but cancellation)."""
    timeout_s = tool.timeout_s or timeout_s

    def result(text: str, error: bool) -> ToolResult:
        return ToolResult(text[:max_chars], error)

    problem = check_arguments(tool, arguments)
    if problem is not None:
        return result(f"error: {problem}", True)
    running = asyncio.ensure_future(_run(tool, arguments))
    running.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved, even after a timeout
    try:
        if (await asyncio.wait({running}, timeout=timeout_s))[0]:
            return result(str(running.result()), False)
        running.cancel()
        # Not asyncio.wait_for, which waits for the cancelled tool to end: one that swallows the cancellation
        # would hold the episode as long as it runs.
        await asyncio.wait({running}, timeout=CANCEL_GRACE_S)
        return result(f"error: timeout after {timeout_s:g}s", True)
    except Exception as error:  # a bad call is an observation for the model, not a crash
        return result(f"error: {error}" if str(error) else f"error: {type(error).__name__}", True)
    finally:
        running.cancel()  # ended already, or this call was cancelled (its episode ended): then the tool is too


async def _run(tool: Tool, arguments: dict) -> Any:
    """The tool's result: awaited, or from a user-code thread (threads.py) when the tool is synchronous."""
    if inspect.iscoroutinefunction(tool.fn):
        return await tool.fn(**arguments)
    return await in_thread(functools.partial(tool.fn, **arguments))
