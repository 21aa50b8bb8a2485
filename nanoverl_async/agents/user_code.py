"""User code by name: the one place that turns a config string into a Python object.

    load_object("builtin:multiply", "agent.env")        # a built-in, per config key
    load_object("my_pkg.envs:Calculator")                # an importable module
    load_object("path/to/my_env.py:Calculator")          # a file; its folder is importable, as for a script

Why one resolver: config keys name environments, prompt functions, reward functions and model builders
the same way, and each role loads them in its own process; `absolute_spec` makes a file path survive a
change of working directory. Nothing here runs at import time: user code runs only when a spec is loaded.

    await call_user("agent.env step()", env.step, sample, message)   # the agent loop calls hooks so

An exception in a user hook becomes a `UserCodeError` whose one line names the hook and the user's
own frames (file:line), not the framework's: that line is what the run's failure message shows.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import sysconfig
import traceback
from pathlib import Path
from typing import Any, Callable

BUILTINS = {  # config key -> built-in name -> the object it stands for
    "agent.env": {"builtin:multiply": "nanoverl_async.agents.multiply_task:MultiplyEnv",
                  "builtin:slow-tool": "nanoverl_async.agents.slow_tool_task:SlowToolEnv",
                  "builtin:long-tail": "nanoverl_async.agents.long_tail_task:LongTailEnv",
                  "builtin:code": "nanoverl_async.agents.code_task:CodeEnv",
                  "builtin:chat": "nanoverl_async.agents.env:Environment"},
    "data.task": {"builtin:multiply": "nanoverl_async.agents.multiply_task:make_prompt",
                  "builtin:long-tail": "nanoverl_async.agents.long_tail_task:make_prompt",
                  "builtin:code": "nanoverl_async.agents.code_task:make_prompt"},
    "model.path": {  # builders fn(cache_dir) -> a model directory, made once and cached (models/cache.py)
        "builtin:tiny": "nanoverl_async.models.tiny:build_tiny",
        "builtin:tiny-long-tail": "nanoverl_async.models.tiny:build_tiny_long_tail",
        "builtin:tiny-code": "nanoverl_async.models.tiny:build_tiny_code",
        "builtin:smollm2-135m": "nanoverl_async.models.smollm2:build_smollm2",
    },
}


def load_object(spec: str, key: str = "") -> Any:
    """`builtin:NAME` (a built-in of config key `key`), `package.module:Name` or `path/to/file.py:Name`
    -> the object; a ValueError names what is wrong."""
    builtins = BUILTINS.get(key, {})
    if spec.startswith("builtin:") and spec not in builtins:
        raise ValueError(f"'{spec}' is not a built-in {key or 'object'}; the built-ins are "
                         f"{', '.join(builtins) or 'none'}")
    spec = builtins.get(spec, spec)
    if ":" not in spec:
        raise ValueError(f"'{spec}' is not of the form package.module:Name or path/to/file.py:Name")
    where, name = spec.rsplit(":", 1)
    module = _load_file(where, spec) if where.endswith(".py") else importlib.import_module(where)
    if not hasattr(module, name):
        raise ValueError(f"'{spec}': {where} has no attribute '{name}'")
    return getattr(module, name)


def _load_file(where: str, spec: str):
    path = Path(where).resolve()
    if not path.is_file():
        raise ValueError(f"'{spec}': file {where} does not exist")
    module_name = f"nanoverl_user_{path.stem}_{abs(hash(str(path))) % 10**8}"
    if module_name not in sys.modules:
        if str(path.parent) not in sys.path:  # modules beside the file import, as they do for a script
            sys.path.append(str(path.parent))
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
        try:
            loader_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    return sys.modules[module_name]


def absolute_spec(spec: str) -> str:
    """`path/to/file.py[:Name]` made absolute, so other processes find it whatever their cwd."""
    where, sep, name = spec.partition(":") if ".py" in spec else (spec, "", "")
    return f"{Path(where).resolve()}{sep}{name}" if where.endswith(".py") else spec


class UserCodeError(RuntimeError):
    """A user hook (environment, rollout, reward, prompt function) raised or broke its contract."""


async def call_user(hook: str, function: Callable, *args) -> Any:
    """`function(*args)`, awaited if it returns an awaitable; what it raises comes back as a UserCodeError
    naming `hook`, the exception and the user's frames."""
    try:
        value = function(*args)
        return await value if inspect.isawaitable(value) else value  # hooks may be sync or async
    except UserCodeError:  # already names its hook (a rollout's own episode.run_tools misuse): not twice
        raise
    except Exception as error:  # noqa: BLE001 - every user error is reported the same way
        raise user_error(hook, error) from error


def user_error(hook: str, error: Exception) -> UserCodeError:
    """One line: the hook, what it raised, and where in the user's own code."""
    return UserCodeError(f"{hook} raised {type(error).__name__}: {error}{user_frames(error)}")


def user_frames(error: BaseException, limit: int = 3) -> str:
    """' at file.py:12 in step <- file.py:30 in helper': the innermost `limit` frames of the traceback
    that are neither this package, nor the standard library, nor installed packages."""
    skip = (str(Path(__file__).parents[1]), *(sysconfig.get_paths()[key] for key in ("stdlib", "purelib", "platlib")))
    frames = [f for f in traceback.extract_tb(error.__traceback__)  # "<string>": generated (a dataclass __init__)
              if not f.filename.startswith(skip) and not f.filename.startswith("<")]
    return " at " + " <- ".join(f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in frames[::-1][:limit]) \
        if frames else ""


def defined_at(function: Callable) -> str:
    """' (defined at file.py:12)' for a user's function or method; '' where its source cannot be found."""
    try:
        function = inspect.unwrap(function)
        return f" (defined at {Path(inspect.getsourcefile(function)).name}:{inspect.getsourcelines(function)[1]})"
    except (TypeError, OSError):  # a builtin, or code without a file
        return ""
