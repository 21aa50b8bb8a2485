"""User code by name: the one place that turns a config string into a Python object.

    load_object("builtin:multiply", "agent.env")        # a built-in, per config key
    load_object("my_pkg.envs:Calculator")                # an importable module
    load_object("path/to/my_env.py:Calculator")          # a file; its folder is importable, as for a script

Why one resolver: config keys name environments, prompt functions, reward functions and model builders
the same way, and each role loads them in its own process; `absolute_spec` makes a file path survive a
change of working directory. Nothing here runs at import time: user code runs only when a spec is loaded.

    await call_user("agent.env Calc.step()", env.step, sample, message,   # the agent loop calls hooks so
                    timeout_s=60.0, key="agent.hook_timeout_s")

An exception in a user hook becomes a `UserCodeError` whose one line names the hook and the user's
own frames (file:line), not the framework's: that line is what the run's failure message shows. So does a
hook that outlives its timeout, with the user's line it was at then: a synchronous hook runs on a user-code
thread (threads.py), whose frames `sys._current_frames` shows, and is left running there, unwatched (Python
cannot stop a thread); an async one is awaited in the episode's task, whose chain of awaits leads to its
frames, and is cancelled. An async hook that blocks (time.sleep in an `async def`) holds the event loop
itself, and no timeout can fire until it lets go: a hook that blocks belongs in a plain `def`.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib
import importlib.util
import inspect
import sys
import sysconfig
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from nanoverl_async.agents.threads import in_thread

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
    """A user hook (environment, rollout, reward, prompt function) raised, broke its contract or hung."""


# The hook call running in this task: a hook it calls (the chat environment's step -> the reward function) finds it.
_RUNNING: contextvars.ContextVar[Optional[_Call]] = contextvars.ContextVar("nanoverl_hook", default=None)


async def call_user(hook: str, function: Callable, *args, timeout_s: Optional[float] = None, key: str = "") -> Any:
    """`function(*args)`: a synchronous one on a user-code thread (threads.py), so one that blocks holds neither
    the event loop nor the other episodes; an async one (or the awaitable a synchronous one returns) awaited.
    It must return within `timeout_s` (config key `key`), else a UserCodeError names the hook, where it is
    defined and the user's line it was at; None: within the bound of the hook it is called from (a reward
    function within an environment's step), unbounded outside any. What it raises comes back as a
    UserCodeError naming `hook`, the exception and the user's frames."""
    call, parent = _Call(hook, function, timeout_s, key), _RUNNING.get()
    if parent is not None:
        parent.inner = call  # while it runs, the enclosing hook's timeout names it
    token = _RUNNING.set(call)
    try:
        if inspect.iscoroutinefunction(function):
            value = function(*args)  # a coroutine: none of its code has run yet
        else:
            value = await call.bounded(in_thread(functools.partial(call.watched, *args)))
        if inspect.isawaitable(value):
            call.coroutine = value
            value = await call.bounded(value)
        return value
    except UserCodeError:  # already names its hook (a rollout's own episode.run_tools misuse): not twice
        raise
    except Exception as error:  # noqa: BLE001 - every user error is reported the same way
        raise user_error(hook, error) from error
    finally:
        call.done = True
        _RUNNING.reset(token)


class _Call:
    """One hook call in flight: its deadline, and where in the user's code it is now."""

    def __init__(self, hook: str, function: Callable, timeout_s: Optional[float], key: str):
        self.hook = hook
        self.function = function
        self.timeout_s = timeout_s
        self.key = key
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.thread: Optional[int] = None  # the thread running a synchronous hook, while it runs
        self.coroutine: Any = None  # an async hook's coroutine
        self.inner: Optional[_Call] = None  # the last hook it called
        self.done = False

    def watched(self, *args) -> Any:
        """`function(*args)` on a user-code thread, which it names while it runs."""
        self.thread = threading.get_ident()
        try:
            return self.function(*args)
        finally:
            self.thread = None

    async def bounded(self, running: Awaitable) -> Any:
        """What `running` gives by the call's deadline (None: whenever), else a UserCodeError saying where the
        call was then. At the deadline a timer reads where the hook is, then cancels this task (the episode's):
        asyncio.timeout would report once the hook has unwound, its frames gone, and Python 3.11's
        asyncio.wait_for, or a task of the hook's own, cost more a call than this timer, and the default job calls
        hundreds of hooks a step (docs/benchmarks.md "Costs behind choices in the code"). So an async hook that
        catches its cancellation and runs on holds its episode, until the generator's group timeout."""
        if self.deadline is None:
            return await running
        task, expired = asyncio.current_task(), []

        def expire() -> None:  # between the loop's steps: an async hook is suspended at one of its awaits
            expired.append(self.timed_out())
            task.cancel()

        timer = asyncio.get_running_loop().call_later(self.deadline - time.monotonic(), expire)
        try:
            value = await running
        except asyncio.CancelledError:
            if expired and _uncancel(task) == 0:  # this timer's cancellation, and nobody else's
                raise expired[0] from None
            raise
        finally:
            timer.cancel()
        if expired:  # it caught the cancellation and returned, late
            _uncancel(task)
            raise expired[0]
        return value

    def timed_out(self) -> UserCodeError:
        """This call's timeout, naming the innermost hook still running within it, and where that is."""
        call = self
        while call.inner is not None and not call.inner.done:
            call = call.inner
        where = call.where()
        return UserCodeError(f"{call.hook}{defined_at(call.function)} did not return within {self.timeout_s:g} s "
                             f"({self.key})" + (f"; it was{where}" if where else ""))

    def where(self) -> str:
        """' at file.py:20 in step <- ...': the user's frames this call is running now, innermost first."""
        thread = self.thread
        if thread is not None:
            frame = sys._current_frames().get(thread)
            return _at(traceback.extract_stack(frame) if frame is not None else [])
        frames, awaited = [], self.coroutine
        while awaited is not None:  # an async hook's chain of awaits, outermost first, to the future it waits on
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is None:
                break
            frames.append((frame, frame.f_lineno))
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
        return _at(traceback.StackSummary.extract(frames, lookup_lines=False))


def _uncancel(task: asyncio.Task) -> int:
    """Withdraw one request to cancel `task` -> how many others remain (Python 3.10 counts none)."""
    return task.uncancel() if hasattr(task, "uncancel") else 0


def user_error(hook: str, error: Exception) -> UserCodeError:
    """One line: the hook, what it raised, and where in the user's own code."""
    return UserCodeError(f"{hook} raised {type(error).__name__}: {error}{user_frames(error)}")


def broken_contract(hook: str, function: Callable, value: Any, expected: str) -> UserCodeError:
    """One line for a hook that returned what its contract refuses: the hook, where it is defined, the value,
    and what it should have returned."""
    return UserCodeError(f"{hook}{defined_at(function)} returned {type(value).__name__} {value!r:.60}; {expected}")


def user_frames(error: BaseException, limit: int = 3) -> str:
    """' at file.py:12 in step <- file.py:30 in helper': the innermost `limit` frames of the traceback
    that are neither this package, nor the standard library, nor installed packages."""
    return _at(traceback.extract_tb(error.__traceback__), limit)


def _at(frames: list[traceback.FrameSummary], limit: int = 3) -> str:
    """' at file.py:12 in step <- ...': the innermost `limit` of `frames` (outermost first) in the user's files."""
    skip = (str(Path(__file__).parents[1]), *(sysconfig.get_paths()[key] for key in ("stdlib", "purelib", "platlib")))
    frames = [f for f in frames  # "<string>": generated (a dataclass __init__)
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
