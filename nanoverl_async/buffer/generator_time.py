"""Where the generators' time goes, per window between two batches (buffer/service.py hands out a window's
shares with each batch): `GatedClock`, measured by the buffer from the lease replies it gives (the gate
refusing new groups), and `WorkShares`, from each generator's own clock (generators/worker.py GeneratorClock);
and what it delivered, `TokenRate`. Pure bookkeeping on the times and totals given: tests/test_buffer_service.py
drives them.
"""

from __future__ import annotations

from collections import deque


class GatedClock:
    """How long generators are refused by the admission gate (an empty lease reply: the staleness bound
    holds them back), as a share of generator time per window between batches: `generators/gated_frac`,
    what raising staleness.max would buy back. A refused generator may still be finishing its groups;
    it starts none until the gate opens (new weights, or the learner consuming a step)."""

    def __init__(self, now: float):
        self.window_start, self.closed_s = now, 0.0
        self.refused_since: dict[int, float] = {}  # generator -> its first refusal in the current spell

    def observe(self, generator_id: int, refused: bool, now: float) -> None:
        if refused:
            self.refused_since.setdefault(generator_id, now)
        elif generator_id in self.refused_since:
            self.closed_s += now - max(self.refused_since.pop(generator_id), self.window_start)

    def fraction(self, now: float, generators: int) -> float:
        """Refused seconds / generator seconds since the last call (spells still open count up to now);
        starts the next window."""
        still_refused = sum(now - max(since, self.window_start) for since in self.refused_since.values())
        share = (self.closed_s + still_refused) / (max(now - self.window_start, 1e-9) * max(1, generators))
        self.window_start, self.closed_s = now, 0.0
        return share


class WorkShares:
    """The generators' own clocks (worker.GeneratorClock: milliseconds since it started, and of them computing and
    waiting on tools, sent with each lease request) as shares of generator time per window between batches:
    `generators/busy_frac` and `generators/tool_wait_frac`, over the time the clocks reported in the window
    (each generator's from its last report before the window to its last within it)."""

    KEYS = ("clock_ms", "busy_ms", "tool_wait_ms")

    def __init__(self):
        self.latest: dict[int, tuple[int, ...]] = {}  # generator -> its newest totals
        self.counted: dict[int, tuple[int, ...]] = {}  # generator -> its totals at the previous window's end

    def observe(self, generator_id: int, request: dict) -> None:
        if all(key in request for key in self.KEYS):
            self.latest[generator_id] = tuple(request[key] for key in self.KEYS)

    def fractions(self) -> dict[str, float]:
        """{generators_busy_frac, generators_tool_wait_frac} since the last call (0 if no clock moved); starts
        the next window."""
        zero = (0,) * len(self.KEYS)
        moved = [sum(max(0, totals[i] - self.counted.get(g, zero)[i]) for g, totals in self.latest.items())
                 for i in range(len(self.KEYS))]
        self.counted = dict(self.latest)
        # (min: the totals are whole milliseconds, each rounded down on its own)
        return {f"generators_{key[:-3]}_frac": min(1.0, value / moved[0]) if moved[0] else 0.0
                for key, value in zip(self.KEYS[1:], moved[1:])}


class TokenRate:
    """Sampled tokens the generators delivered per second over the latest `windows` windows between batches:
    `tokens/generated_per_s`. Tokens arrive with their finished episode, so one window (a step whose batch was
    ready at once) can hold none while every generator is decoding, and the next one the tokens of two: over a
    few windows the rate is what generation delivered, and 0 only if nothing arrived in all of them. The first
    window starts at the first lease, before which nothing is generated."""

    def __init__(self, windows: int):
        self.tokens, self.window_start = 0, None  # the current window's tokens; its start (None: no lease yet)
        self.closed: deque = deque(maxlen=windows)  # (start, tokens) of the latest windows

    def start(self, now: float) -> None:
        """A lease was granted at `now`: generation may begin (the first one starts the first window)."""
        if self.window_start is None:
            self.window_start = now

    def rate(self, now: float) -> float:
        """Tokens per second over the latest windows, the current one ended at `now`; starts the next window (none
        before the first lease: a resumed run's first batches may come from restored groups)."""
        if self.window_start is not None:
            self.closed.append((self.window_start, self.tokens))
            self.tokens, self.window_start = 0, now
        seconds = now - self.closed[0][0] if self.closed else 0.0
        return sum(tokens for _, tokens in self.closed) / seconds if seconds > 0 else 0.0
