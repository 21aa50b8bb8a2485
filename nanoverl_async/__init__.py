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

_EXPORTS = {  # module -> the names it exports
    "nanoverl_async.agents.env": ("Environment", "Step", "rollout_tools"),
    "nanoverl_async.agents.user_code": ("load_object",),
    "nanoverl_async.agents.tools": ("Tool", "ToolResult", "as_tool", "call_tool"),
    "nanoverl_async.agents.sandbox": ("python", "run_python", "SandboxLimits"),
    "nanoverl_async.agents.agent_loop": ("Episode", "run_episode"),
    "nanoverl_async.agents.rewards": ("math_compute_score",),
    "nanoverl_async.agents.data": ("DatasetPrompts",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'nanoverl_async' has no attribute '{name}'")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)


def __dir__():
    return __all__
