"""The replay buffer: trajectories grouped by lease, handed out as complete groups, oldest first.

A group is opened when its lease is granted (`open`), fills up with its G trajectories (`add`), and
is then ready. `take(v, B, eta)`, for the batch that updates weights v, is the consumption check of
docs/design.md "The consumption check":

  1. every ready group with v - u > eta (u = the group's version, the minimum over its trajectories)
     is removed and returned as dropped, so the caller can give its slot back and re-issue its prompt;
  2. then the B oldest ready groups (by version, then completion order) are removed and returned, by
     version and then lease order, or none at all if fewer than B are ready (never a partial batch).

With `group_filter` (DAPO dynamic sampling, Yu et al. 2025, arXiv:2503.14476), a group whose G rewards
all tie is dropped the moment it completes (`add` returns FILTERED, counted in `filtered`): its
advantages would all be 0, so it carries no gradient; the caller gives its slot back without re-issuing
the prompt, and generation keeps pulling until B informative groups are ready.

Invariants: a trajectory only joins the open group named by its group_id, at an unused sample_index and
with an id no other member has;
a trajectory for an unknown group (a straggler of an expired lease, whose prompt now runs under a new
group_id) or a duplicate sample is dropped and counted, never mixed in. Every group handed out has G
trajectories, ordered by sample_index, and satisfies v - u <= eta.

Checkpoints (`state` / `restore`): ready groups with their trajectories (the trajectory wire codec,
never pickle), the partial groups' finished trajectories, and the counters. `restore` keeps only the
ready groups whose leases the restored gate kept; partial groups are discarded with their leases
(gate.py), their trajectories are in the file only as a record of the in-flight work at save time.

Run alone: `python -m pytest tests/test_replay.py -q`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoverl_async.wire import trajectory as wire
from nanoverl_async.wire.trajectory import Trajectory

# What `add` did with a trajectory.
ADDED = "added"  # joined its open group, which still waits for more
COMPLETED = "completed"  # joined its group, which is now complete and ready
STRAGGLER = "straggler"  # its group is unknown, expired, released or already handed out: dropped
DUPLICATE = "duplicate"  # its group (open or ready) already holds this sample_index or trajectory id: dropped
MISMATCH = "mismatch"  # sample_index out of range or prompt_index not the group's: dropped
FILTERED = "filtered"  # completed its group, whose rewards all tie, and group_filter is on: group dropped


@dataclass
class Group:
    group_id: int
    prompt_index: int
    lease_version: int  # the generator's version when it leased the group
    samples: dict[int, Trajectory] = field(default_factory=dict)  # sample_index -> trajectory
    arrival: int = -1  # completion order, the tie-break among groups of one version

    @property
    def version(self) -> int:
        """min over its trajectories' versions; the lease version if none sampled a token (a lower bound
        anyway: in both weight-sync modes a token's version is >= the version held at lease time)."""
        versions = [v for v in (t.version for t in self.samples.values()) if v >= 0]
        return min(versions) if versions else self.lease_version

    @property
    def trajectories(self) -> list[Trajectory]:
        return [self.samples[i] for i in sorted(self.samples)]


class ReplayBuffer:
    def __init__(self, group_size: int, group_filter: bool = False):
        self.group_size = group_size  # G
        self.group_filter = group_filter  # drop complete groups whose rewards all tie
        self.open_groups: dict[int, Group] = {}  # group_id -> group still waiting for trajectories
        self.ready: dict[int, Group] = {}  # group_id -> complete group, not yet handed out
        self._arrivals = 0
        self.counters = {"dropped_stragglers": 0, "dropped_duplicates": 0, "dropped_mismatched": 0, "dropped_stale": 0,
                         "dropped_filtered": 0}

    def open(self, group_id: int, prompt_index: int, lease_version: int) -> None:
        assert group_id not in self.open_groups and group_id not in self.ready, f"group {group_id} reopened"
        self.open_groups[group_id] = Group(group_id, prompt_index, lease_version)

    def close(self, group_id: int) -> None:
        """Forget an incomplete group (its lease expired or was released); later arrivals are stragglers."""
        self.open_groups.pop(group_id, None)
        self.ready.pop(group_id, None)

    def add(self, trajectory: Trajectory) -> str:
        """File one trajectory under its group; returns ADDED, COMPLETED, FILTERED (the completed group was
        dropped by the group filter) or the reason the trajectory was dropped."""
        group = self.open_groups.get(trajectory.group_id) or self.ready.get(trajectory.group_id)
        if group is None:
            self.counters["dropped_stragglers"] += 1
            return STRAGGLER
        if not 0 <= trajectory.sample_index < self.group_size or trajectory.prompt_index != group.prompt_index:
            self.counters["dropped_mismatched"] += 1
            return MISMATCH
        if trajectory.sample_index in group.samples or any(t.id == trajectory.id for t in group.samples.values()):
            self.counters["dropped_duplicates"] += 1
            return DUPLICATE
        group.samples[trajectory.sample_index] = trajectory
        if len(group.samples) < self.group_size:
            return ADDED
        del self.open_groups[group.group_id]
        if self.group_filter and len({t.reward for t in group.samples.values()}) == 1:
            self.counters["dropped_filtered"] += 1
            return FILTERED
        group.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        self.ready[group.group_id] = group
        return COMPLETED

    def take(self, version: int, batch_groups: int, staleness: int) -> tuple[list[Group], list[Group]]:
        """The consumption check for the batch that updates weights `version`, then the `batch_groups` oldest fresh
        groups (or none): (groups, dropped)."""
        version_of = {group.group_id: group.version for group in self.ready.values()}  # a min over arrays: once each
        dropped = [g for g in self.ready.values() if version - version_of[g.group_id] > staleness]
        for group in dropped:
            del self.ready[group.group_id]
        self.counters["dropped_stale"] += len(dropped)
        if len(self.ready) < batch_groups:
            return [], dropped
        oldest = sorted(self.ready.values(), key=lambda g: (version_of[g.group_id], g.arrival))[:batch_groups]
        for group in oldest:
            del self.ready[group.group_id]
        # Oldest first, then in lease order rather than completion order: the learner sums in batch order,
        # and completion order depends on timing (run.deterministic needs the same batch in the same order).
        return sorted(oldest, key=lambda g: (version_of[g.group_id], g.group_id)), dropped

    def state(self) -> dict:
        """Ready and partial groups (trajectories as `trajectory.encode` bytes) and the counters."""
        def group_state(group: Group) -> list:
            return [group.group_id, group.prompt_index, group.lease_version, group.arrival,
                    [wire.encode(t) for t in group.trajectories]]
        return {"ready": [group_state(g) for g in self.ready.values()],
                "partial": [group_state(g) for g in self.open_groups.values()],
                "arrivals": self._arrivals, "counters": dict(self.counters)}

    def restore(self, state: dict, keep: list[int]) -> None:
        """Load `state()` into this (empty) buffer: the ready groups named in `keep` (the restored gate's
        complete leases), in their saved completion order. Partial groups are not restored (see above)."""
        assert not self.ready and not self.open_groups, "restore into an empty buffer only"
        for group_id, prompt_index, lease_version, arrival, encoded in state["ready"]:
            group = Group(group_id, prompt_index, lease_version, arrival=arrival)
            group.samples = {t.sample_index: t for t in map(wire.decode, encoded)}
            assert len(group.samples) == self.group_size, f"group {group_id}: {len(group.samples)} samples"
            self.ready[group_id] = group
        assert set(self.ready) == set(keep), f"ready groups {sorted(self.ready)} != complete leases {sorted(keep)}"
        self._arrivals, self.counters = state["arrivals"], dict(state["counters"])
