"""The admission gate and the prompt frontier: which prompt a generator may start, and when.

A lease is one prompt group (G episodes of one prompt) handed to one generator. The gate owns the
prompt frontier: the next fresh prompt index, a queue of prompts to re-issue, and the live leases.

Admission (docs/design.md "The admission gate", AReaL's rule made stricter): a generator holding
weights of version u may start a new group only while

    groups_started < (u + eta + 1) * B,  groups_started = in flight + complete (buffered) + consumed.

A released (dropped, filtered) or expired group gives its slot back; otherwise the gate and the
learner would wait on each other forever.

Invariants (property-tested in tests/test_replay.py with the replay buffer):
  - every prompt index below `next_index` is in exactly one place: the re-issue queue, a live lease,
    or done (consumed, or released without re-issue); re-issued prompts are leased before new ones;
  - groups_started == leased - released - expired == live leases + consumed;
  - `lease(u, n, now)` never grants more than (u + eta + 1) * B - groups_started groups.
A lease carries a deadline: `expire(now)` frees every incomplete lease past it (slot back, prompt
re-issued), so a group that can never complete (a corrupt message, a dead generator) cannot block.

Checkpoints (`state` / `restore`): the frontier, the counters and the live leases. A restored gate
keeps complete leases (their groups are restored in the replay buffer) and returns every lease that
was in flight for re-issue, once, as `release` does; it refuses generators below `min_version` (the
restored weights), so no episode of a resumed run is sampled by weights older than the checkpoint.

Run alone: `python -m pytest tests/test_gate.py -q`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable


@dataclass
class Lease:
    group_id: int  # unique per lease; a re-issued prompt gets a new one, so stragglers never mix in
    prompt_index: int
    sample: dict  # prompt_fn(prompt_index), JSON-able
    version: int  # the generator's weight version at admission
    generator_id: int
    deadline: float  # clock seconds; an incomplete lease past it is expired by expire(now)
    complete: bool = False  # all G trajectories arrived: no deadline any more, waits to be consumed


class AdmissionGate:
    def __init__(self, prompts_per_step: int, staleness: int, lease_timeout_s: float,
                 prompt_fn: Callable[[int], dict]):
        self.prompts_per_step = prompts_per_step  # B
        self.staleness = staleness  # eta
        self.lease_timeout_s = lease_timeout_s
        self.prompt_fn = prompt_fn
        self.next_index = 0  # the next fresh prompt index
        self.reissue: deque[int] = deque()  # prompts to lease again, before any fresh index
        self.live: dict[int, Lease] = {}  # group_id -> lease, in flight or complete (not consumed)
        self._next_group_id = 0
        self.counters = {"leased": 0, "completed": 0, "consumed": 0, "released": 0, "expired": 0,
                         "reissued": 0}
        self.min_version = 0  # a generator below it gets no lease (a resumed run: the checkpoint's version)

    @property
    def groups_started(self) -> int:
        """Groups holding a slot: in flight + complete (buffered) + consumed."""
        return self.counters["leased"] - self.counters["released"] - self.counters["expired"]

    def in_flight(self, generator_id: int | None = None) -> int:
        """Leased groups not yet complete: all of them, or those of one generator."""
        return sum(1 for lease in self.live.values()
                   if not lease.complete and generator_id in (None, lease.generator_id))

    def capacity(self, version: int) -> int:
        """How many more groups a generator holding `version` may start now."""
        return max(0, (version + self.staleness + 1) * self.prompts_per_step - self.groups_started)

    def lease(self, version: int, max_groups: int, now: float, generator_id: int = 0) -> list[Lease]:
        """Up to `max_groups` new leases for a generator at `version`; [] while the gate is closed. Both are
        >= 0 (the service's parse_request refuses anything else)."""
        leases = []
        if version < self.min_version:
            return leases  # still on weights older than the checkpoint it resumed from: wait for newer ones
        for _ in range(min(max_groups, self.capacity(version))):
            if self.reissue:
                index = self.reissue.popleft()
            else:
                index, self.next_index = self.next_index, self.next_index + 1
            lease = Lease(self._next_group_id, index, self.prompt_fn(index), version, generator_id,
                          now + self.lease_timeout_s)
            self._next_group_id += 1
            self.live[lease.group_id] = lease
            self.counters["leased"] += 1
            leases.append(lease)
        return leases

    def complete(self, group_id: int) -> None:
        """All G trajectories of the group arrived: it keeps its slot but can no longer expire."""
        lease = self._get(group_id, "complete")
        assert not lease.complete, f"group {group_id} completed twice"
        lease.complete = True
        self.counters["completed"] += 1

    def consume(self, group_id: int) -> None:
        """The group went to the learner: its prompt is done, its slot stays taken for good."""
        lease = self._get(group_id, "consume")
        assert lease.complete, f"group {group_id} consumed before it was complete"
        del self.live[group_id]
        self.counters["consumed"] += 1

    def release(self, group_id: int, reissue: bool = True) -> None:
        """Drop a live group (stale, filtered): slot back; its prompt is re-issued unless told not to."""
        self._get(group_id, "release")
        self._free(group_id, "released", reissue)

    def expire(self, now: float) -> list[int]:
        """Free every incomplete lease whose deadline passed; returns their group ids."""
        expired = [g for g, lease in self.live.items() if not lease.complete and lease.deadline <= now]
        for group_id in expired:
            self._free(group_id, "expired", reissue=True)
        return expired

    def frontier(self) -> dict:
        """A JSON-able snapshot of where every prompt is (for tests, metrics and checkpoints)."""
        return {"next_index": self.next_index, "reissue": list(self.reissue),
                "live": {g: lease.prompt_index for g, lease in self.live.items()}}

    def state(self) -> dict:
        """Everything `restore` needs, msgpack-able (samples are not stored: prompt_fn recomputes them)."""
        live = [[lease.group_id, lease.prompt_index, lease.version, lease.generator_id, lease.complete]
                for lease in self.live.values()]
        return {"next_index": self.next_index, "reissue": list(self.reissue), "live": live,
                "next_group_id": self._next_group_id, "counters": dict(self.counters)}

    def restore(self, state: dict, min_version: int, now: float) -> list[int]:
        """Load `state()` into this (fresh) gate; in-flight leases are released for re-issue. Returns
        the group ids of the complete leases kept (their groups must be restored in the replay buffer)."""
        assert not self.live and self.counters["leased"] == 0, "restore into a fresh gate only"
        self.next_index, self.reissue = state["next_index"], deque(state["reissue"])
        self._next_group_id, self.counters = state["next_group_id"], dict(state["counters"])
        self.min_version = min_version
        for group_id, index, version, generator_id, complete in state["live"]:
            self.live[group_id] = Lease(group_id=group_id, prompt_index=index, sample=self.prompt_fn(index),
                                        version=version, generator_id=generator_id,
                                        deadline=now + self.lease_timeout_s, complete=complete)
            if not complete:  # its generator's episodes died with the old run: the prompt goes out again
                self.release(group_id, reissue=True)
        return list(self.live)

    def _free(self, group_id: int, counter: str, reissue: bool) -> None:
        """The live lease gives its slot back (`counter`: released or expired) and, if asked, its prompt."""
        lease = self.live.pop(group_id)
        self.counters[counter] += 1
        if reissue:
            self.reissue.append(lease.prompt_index)
            self.counters["reissued"] += 1

    def _get(self, group_id: int, action: str) -> Lease:
        if group_id not in self.live:
            raise KeyError(f"cannot {action} group {group_id}: not a live lease")
        return self.live[group_id]
