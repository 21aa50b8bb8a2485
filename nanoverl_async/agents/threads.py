"""Daemon threads for synchronous user code: tools (tools.call_tool) and hooks (user_code.call_user) run on
them, off the generator's event loop, so one that blocks holds neither the loop nor the other episodes, and
its call can time out.

    future = in_thread(functools.partial(step, sample, message))   # an asyncio future of step(sample, message)

A call is taken by an idle thread, or by a new one when none is idle, so calls never queue; finished threads
wait for the next call (a thread started per call showed in the default job's step:
docs/benchmarks.md "Costs behind choices in the code"). Not asyncio.to_thread: its pool has min(32, CPUs + 4)
threads, so the calls of many concurrent episodes would queue for them past their timeouts, a call that never
returns would hold one for good, and the pool is joined at
exit. Python cannot kill a thread: after a timeout the call runs on, unwatched (a daemon, it does not keep the
process alive at exit), so code that may run away belongs in `nanoverl_async.agents.sandbox` (a killable
subprocess).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import queue
import threading
from typing import Any, Callable, Optional


class _Threads:
    """The reused daemon threads: one per call in flight, at the most."""

    def __init__(self):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, work: Callable[[], Any], deliver: Callable[[Any], None]) -> None:
        """Run `work()` on one of the threads, then `deliver` its return value."""
        with self._lock:
            start = self._idle == 0
            self._idle -= not start
        self._calls.put((work, deliver))
        if start:
            threading.Thread(target=self._serve, name="user-code", daemon=True).start()

    def _serve(self) -> None:
        while True:
            work, deliver = self._calls.get()
            outcome = work()
            with self._lock:  # idle before the result is out: the caller's next call takes this thread
                self._idle += 1
            deliver(outcome)


_THREADS = _Threads()


def in_thread(function: Callable[[], Any]) -> asyncio.Future:
    """Run `function()` on one of the threads -> a future of its result (or of what it raised), on the running
    loop; cancelling the future drops the result, the call itself runs on."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: Optional[BaseException]) -> None:
        if future.done():  # cancelled: the call timed out or its episode ended
            return
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    def work() -> tuple[Any, Optional[BaseException]]:
        try:
            return function(), None
        except BaseException as error:  # noqa: BLE001 - handed to the caller, as asyncio.to_thread does
            return None, error

    def deliver(outcome: tuple[Any, Optional[BaseException]]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits for the result
            loop.call_soon_threadsafe(settle, *outcome)

    # the caller's context variables, as asyncio.to_thread passes them
    _THREADS.submit(functools.partial(contextvars.copy_context().run, work), deliver)
    return future
