"""How a model writes tool calls: parse one sampled assistant turn into (content, calls).

Two formats, chosen by `Environment.tool_format`:
  - "hermes" (Qwen2.5/Qwen3, Hermes, many others): any number of
        <tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>
    blocks in the turn, which ends at the eos token; the text before the first block is the content.
  - "builtin" (the embedded tiny model, nanoverl_async/agents/multiply_task.py): `...<call>EXPR</call>`;
    generation stops at the `</call>` token and EXPR is the first argument of the environment's one tool
    (env.env_factory refuses more than one in this format: the call names none);
  - "json" (Llama-3.1/3.2 style): a turn that is one JSON object `{"name": ..., "parameters": {...}}`
    is one call; any other turn is a final answer.

`describe_tools` and `write_calls` write the other direction: for a chat template that drops the tools it is
given (SmolLM2's), the schemas and how to call them in the format, as a system message (agent_loop.Episode);
and a turn that calls tools, as the format writes it (a warm start's demonstrations, controller/warm_start.py).

Invariant: parsing never raises. A block that is not valid JSON, lacks a "name", or has arguments that
are not an object becomes a `ParsedCall` with `error` set (the agent loop turns it into an error
observation); an unclosed `<tool_call>` at the end of a turn is a malformed call too. Arguments given
as a JSON string (some models do) are decoded once.

Run alone: `python -m pytest tests/test_tools.py -q`.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Optional

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
BUILTIN_OPEN, BUILTIN_CLOSE = "<call>", "</call>"
FORMATS = ("hermes", "builtin", "json")
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", flags=re.S)


@dataclass
class ParsedCall:
    name: str  # "" when it could not be read
    arguments: dict = field(default_factory=dict)
    error: Optional[str] = None  # set for a malformed call: the observation says why


def stop_strings(tool_format: str) -> tuple[str, ...]:
    """Token texts (besides eos) that end a turn for this format."""
    return (BUILTIN_CLOSE,) if tool_format == "builtin" else ()


def parse_turn(text: str, tool_format: str, default_tool: str = "",
               default_arg: str = "") -> tuple[str, list[ParsedCall]]:
    """A sampled turn's text (eos removed) -> (content, calls). No calls: a final answer."""
    if tool_format not in FORMATS:
        raise ValueError(f"tool format {tool_format!r} is not one of {', '.join(FORMATS)}")
    if tool_format == "builtin":
        return parse_builtin(text, default_tool, default_arg)
    return parse_hermes(text) if tool_format == "hermes" else parse_json(text)


def parse_builtin(text: str, tool: str, arg: str) -> tuple[str, list[ParsedCall]]:
    if not text.endswith(BUILTIN_CLOSE):
        return text, []
    body = text[: -len(BUILTIN_CLOSE)]
    start = body.rfind(BUILTIN_OPEN)
    if start < 0:
        return body, [ParsedCall(tool, {}, "malformed call")]
    expression = body[start + len(BUILTIN_OPEN):]
    return body[:start], [ParsedCall(tool, {arg: expression}, None if expression.strip() else "malformed call")]


def parse_hermes(text: str) -> tuple[str, list[ParsedCall]]:
    first = text.find(HERMES_OPEN)
    if first < 0:
        return text, []
    content = text[:first].rstrip("\n")
    calls = [_hermes_call(block) for block in _HERMES_BLOCK.findall(text)]
    tail = text[text.rfind(HERMES_CLOSE) + len(HERMES_CLOSE):] if HERMES_CLOSE in text else text[first:]
    if HERMES_OPEN in tail:  # a block opened but never closed (e.g. cut by the token limit)
        calls.append(ParsedCall("", {}, "malformed call: <tool_call> without </tool_call>"))
    return content, calls


def _hermes_call(block: str) -> ParsedCall:
    try:
        call = json.loads(block)
    except json.JSONDecodeError as error:
        return ParsedCall("", {}, f"malformed call: invalid JSON ({error.msg} at char {error.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ParsedCall("", {}, 'malformed call: expected {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return ParsedCall(call["name"], {}, "malformed call: arguments must be a JSON object")
    return ParsedCall(call["name"], arguments)


def parse_json(text: str) -> tuple[str, list[ParsedCall]]:
    stripped = text.strip()
    if not (stripped.startswith("{") and stripped.endswith("}")):
        return text, []
    call = _hermes_call(stripped)
    if call.error is not None and not stripped.startswith('{"name"'):
        return text, []  # JSON that is not a call attempt is an answer
    return "", [call]


def describe_tools(schemas: list[dict], tool_format: str) -> str:
    """A system-message text showing a model `schemas` (OpenAI-style function schemas) and how to call one in
    `tool_format`: what a chat template that renders `tools=` would have shown it."""
    if tool_format not in FORMATS:
        raise ValueError(f"tool format {tool_format!r} is not one of {', '.join(FORMATS)}")
    listing = "\n".join(json.dumps(schema) for schema in schemas)
    if tool_format == "hermes":
        how = (f'To call a tool, write {HERMES_OPEN}{{"name": <tool name>, "arguments": <its arguments as a JSON '
               f'object>}}{HERMES_CLOSE}; each result comes back in a message of its own.')
    elif tool_format == "json":
        how = ('To call a tool, reply with only {"name": <tool name>, "parameters": <its arguments as a JSON '
               'object>}.')
    else:  # builtin: the first tool, with its first argument (parse_builtin)
        name = schemas[0]["function"]["name"]
        how = f"To call {name}, end your reply with {BUILTIN_OPEN}<its argument>{BUILTIN_CLOSE}."
    return f"You can call these tools, given as JSON schemas:\n<tools>\n{listing}\n</tools>\n{how}"


def write_calls(calls: list[dict], tool_format: str) -> str:
    """The text of an assistant turn making `calls` ({"name": ..., "arguments": {...}} each) in `tool_format`,
    which `parse_turn` reads back as those calls. "json" and "builtin" write one call a turn; "builtin" names
    no tool and writes the value of the first argument."""
    if tool_format not in FORMATS:
        raise ValueError(f"tool format {tool_format!r} is not one of {', '.join(FORMATS)}")
    if tool_format != "hermes" and len(calls) != 1:
        raise ValueError(f"the {tool_format} format writes one call a turn, not {len(calls)}")
    if tool_format == "builtin":
        return f"{BUILTIN_OPEN}{next(iter(calls[0]['arguments'].values()), '')}{BUILTIN_CLOSE}"
    if tool_format == "json":
        return json.dumps({"name": calls[0]["name"], "parameters": calls[0]["arguments"]})
    return "".join(f"{HERMES_OPEN}{json.dumps({'name': c['name'], 'arguments': c['arguments']})}{HERMES_CLOSE}"
                   for c in calls)
