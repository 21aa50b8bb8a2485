"""nanoverl-async: asynchronous off-policy RL for LLMs. The public API for writing tasks:

    from nanoverl_async import Environment, Step, as_tool

    Environment, Step        an environment class and what its step returns   (env.py)
    rollout_tools            the tools a plain `rollout` function runs          (env.py)
    as_tool, Tool, call_tool typed functions as tools: schema, checks, timeout (tools.py)
    python, run_python, SandboxLimits   a sandboxed Python tool              (sandbox.py)
    Episode                  what a full-control `rollout(episode, sample)` drives (agents/agent_loop.py)
    math_compute_score       the default verl-style reward                    (rewards.py)
    DatasetPrompts           verl-format parquet/jsonl prompts                 (data.py)

Imports are lazy (PEP 562), so `import nanoverl_async` loads neither torch nor transformers.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Environment": "nanoverl_async.agents.env",
    "Step": "nanoverl_async.agents.env",
    "rollout_tools": "nanoverl_async.agents.env",
    "load_object": "nanoverl_async.agents.user_code",
    "Tool": "nanoverl_async.agents.tools",
    "ToolResult": "nanoverl_async.agents.tools",
    "as_tool": "nanoverl_async.agents.tools",
    "call_tool": "nanoverl_async.agents.tools",
    "python": "nanoverl_async.agents.sandbox",
    "run_python": "nanoverl_async.agents.sandbox",
    "SandboxLimits": "nanoverl_async.agents.sandbox",
    "Episode": "nanoverl_async.agents.agent_loop",
    "run_episode": "nanoverl_async.agents.agent_loop",
    "math_compute_score": "nanoverl_async.agents.rewards",
    "DatasetPrompts": "nanoverl_async.agents.data",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nanoverl_async' has no attribute '{name}'")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__():
    return __all__
