"""The replay buffer and the consumption check, alone and together with the admission gate.

The property test drives gate + replay through random interleavings of generators leasing (each at
its own version, never above the learner's), episodes finishing in random order with token versions
in [lease version, learner version] (weight_sync.mode=interrupt), duplicates, filtered groups,
training steps and lease expiry, and checks the staleness contract (docs/design.md "Versions and staleness") and the prompt frontier:
  - at admission, groups_started never exceeds (u + eta + 1) * B;
  - every batch has exactly B complete groups and t - u <= eta for every trajectory;
  - every prompt index is consumed at most once, and every index ever leased is consumed, retired
    (filtered), in a live lease or waiting to be re-issued: never lost.
Fast, no sockets.
"""

import itertools

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from nanoverl_async.buffer.gate import AdmissionGate
from nanoverl_async.buffer.replay import ADDED, COMPLETED, DUPLICATE, FILTERED, MISMATCH, STRAGGLER, ReplayBuffer
from nanoverl_async.wire.trajectory import Trajectory

TIMEOUT = 20.0
_ids = itertools.count()


def make_trajectory(group_id, prompt_index, sample_index, token_versions, reward=0.0) -> Trajectory:
    """A 2-token prompt followed by one sampled token per entry of token_versions."""
    versions = np.array([-1, -1] + list(token_versions), dtype=np.int32)
    mask = (versions >= 0).astype(np.uint8)
    return Trajectory(id=f"t{next(_ids)}", group_id=group_id, prompt_index=prompt_index,
                      sample_index=sample_index, token_ids=np.arange(len(versions), dtype=np.int32),
                      loss_mask=mask, behaviour_logprobs=-0.1 * mask.astype(np.float32), versions=versions,
                      reward=reward)


def fill(replay, group_id, prompt_index, versions):
    """Add one trajectory per entry of `versions` (sample_index = position); returns the outcomes."""
    return [replay.add(make_trajectory(group_id, prompt_index, i, [v])) for i, v in enumerate(versions)]


def test_groups_complete_at_group_size_and_come_out_oldest_first():
    replay = ReplayBuffer(group_size=2)
    for group_id, prompt in [(0, 10), (1, 11), (2, 12)]:
        replay.open(group_id, prompt, lease_version=0)
    assert fill(replay, 1, 11, [1, 1]) == [ADDED, COMPLETED]  # version 1, arrives first
    assert fill(replay, 2, 12, [0, 2]) == [ADDED, COMPLETED]  # version 0 = min over trajectories
    assert replay.take(version=2, batch_groups=3, staleness=2) == ([], [])  # only 2 ready: nothing taken
    assert fill(replay, 0, 10, [2, 2]) == [ADDED, COMPLETED]
    groups, dropped = replay.take(version=2, batch_groups=2, staleness=2)
    assert dropped == [] and [g.group_id for g in groups] == [2, 1]
    assert [t.sample_index for t in groups[0].trajectories] == [0, 1]
    assert len(replay.ready) == 1 and not replay.open_groups


def test_stragglers_duplicates_and_mismatches_are_dropped_and_counted():
    replay = ReplayBuffer(group_size=2)
    replay.open(5, prompt_index=50, lease_version=0)
    assert replay.add(make_trajectory(5, 50, 0, [0])) == ADDED
    assert replay.add(make_trajectory(5, 50, 0, [0])) == DUPLICATE
    assert replay.add(make_trajectory(5, 51, 1, [0])) == MISMATCH  # wrong prompt for the group
    assert replay.add(make_trajectory(5, 50, 2, [0])) == MISMATCH  # sample_index >= G
    assert replay.add(make_trajectory(6, 60, 0, [0])) == STRAGGLER  # never leased
    replay.close(5)  # the lease expired: the partial group is forgotten
    assert replay.add(make_trajectory(5, 50, 1, [0])) == STRAGGLER
    assert replay.counters == {"dropped_stragglers": 2, "dropped_duplicates": 1, "dropped_mismatched": 2, "dropped_stale": 0, "dropped_filtered": 0}
    assert not replay.open_groups and len(replay.ready) == 0


def test_group_without_sampled_tokens_takes_the_lease_version():
    replay = ReplayBuffer(group_size=1)
    replay.open(0, 0, lease_version=3)
    replay.add(make_trajectory(0, 0, 0, []))
    assert replay.ready[0].version == 3


def test_group_filter_drops_tied_groups_and_gives_their_slot_back_without_reissue():
    B, G = 1, 2
    gate = AdmissionGate(B, 0, TIMEOUT, prompt_fn=lambda i: {"index": i})
    replay = ReplayBuffer(G, group_filter=True)
    tied, informative = gate.lease(version=1, max_groups=2, now=0.0)
    for lease, rewards in [(tied, [1.0, 1.0]), (informative, [0.0, 1.0])]:
        replay.open(lease.group_id, lease.prompt_index, lease.version)
        outcomes = [replay.add(make_trajectory(lease.group_id, lease.prompt_index, i, [1], reward))
                    for i, reward in enumerate(rewards)]
        assert outcomes == [ADDED, FILTERED if lease is tied else COMPLETED]
    gate.release(tied.group_id, reissue=False)  # what BufferService does with FILTERED
    assert replay.counters["dropped_filtered"] == 1 and len(replay.ready) == 1
    assert gate.groups_started == 1 and gate.frontier()["reissue"] == []  # slot back, prompt consumed
    assert replay.add(make_trajectory(tied.group_id, tied.prompt_index, 0, [1])) == STRAGGLER
    groups, _ = replay.take(version=1, batch_groups=B, staleness=0)
    assert [g.group_id for g in groups] == [informative.group_id]


def test_consumption_check_drops_stale_group_and_gate_reissues_its_prompt():
    B, G, eta = 1, 2, 1
    gate = AdmissionGate(B, eta, TIMEOUT, prompt_fn=lambda i: {"index": i})
    replay = ReplayBuffer(G)
    old, fresh = gate.lease(version=0, max_groups=2, now=0.0)
    for lease, version in [(old, 0), (fresh, 2)]:
        replay.open(lease.group_id, lease.prompt_index, lease.version)
        assert fill(replay, lease.group_id, lease.prompt_index, [version] * G)[-1] == COMPLETED
        gate.complete(lease.group_id)
    # the update of version 2 may use version >= 1: the version-0 group is dropped, the version-2 group is taken
    groups, dropped = replay.take(version=2, batch_groups=B, staleness=eta)
    assert [g.group_id for g in dropped] == [old.group_id] and [g.group_id for g in groups] == [fresh.group_id]
    assert replay.counters["dropped_stale"] == 1
    started = gate.groups_started
    gate.release(old.group_id)  # what BufferService.next_batch does with `dropped`
    gate.consume(fresh.group_id)
    assert gate.groups_started == started - 1  # the slot came back
    assert gate.counters["reissued"] == 1 and gate.frontier()["reissue"] == [old.prompt_index]
    (again,) = gate.lease(version=2, max_groups=1, now=1.0)
    assert again.prompt_index == old.prompt_index and again.group_id != old.group_id


def test_consumption_check_keeps_lag_eta_and_drops_eta_plus_one():
    """v - u <= eta is fresh: the update of version 3 with eta 1 takes a version-2 group and drops a version-1 one."""
    replay = ReplayBuffer(group_size=1)
    for group_id, version in [(0, 1), (1, 2)]:
        replay.open(group_id, prompt_index=group_id, lease_version=version)
        assert fill(replay, group_id, group_id, [version]) == [COMPLETED]
    groups, dropped = replay.take(version=3, batch_groups=1, staleness=1)
    assert [g.group_id for g in groups] == [1] and [g.group_id for g in dropped] == [0]


def test_gate_alone_does_not_bound_staleness_of_a_long_tail():
    """docs/design.md "The consumption check": the gate is exact only if groups finish in the order they started. A group leased at
    version 0 that finishes after two steps (B=1, eta=1) passes the gate; the consumption check drops it."""
    gate, replay = AdmissionGate(1, 1, TIMEOUT, prompt_fn=lambda i: {"index": i}), ReplayBuffer(1)

    def lease_and_finish(version, finish):
        leases = gate.lease(version, max_groups=2, now=0.0)
        for lease in leases:
            replay.open(lease.group_id, lease.prompt_index, lease.version)
        for lease in leases[len(leases) - finish:]:
            assert fill(replay, lease.group_id, lease.prompt_index, [version]) == [COMPLETED]
            gate.complete(lease.group_id)
        return leases

    tail, _ = lease_and_finish(version=0, finish=1)  # 2 slots at version 0: the first is the long tail
    for step in (0, 1):
        (group,), _ = replay.take(step, 1, 1)
        gate.consume(group.group_id)
        lease_and_finish(version=step + 1, finish=1)  # the generator got new weights: one more slot
    assert fill(replay, tail.group_id, tail.prompt_index, [0]) == [COMPLETED]  # finally done, version 0
    groups, dropped = replay.take(version=2, batch_groups=1, staleness=1)
    assert [g.group_id for g in dropped] == [tail.group_id]
    assert all(2 - t.version <= 1 for g in groups for t in g.trajectories)


class GateAndReplay(RuleBasedStateMachine):
    @initialize(B=st.integers(1, 3), G=st.integers(1, 3), eta=st.integers(0, 2), generators=st.integers(1, 3))
    def setup(self, B, G, eta, generators):
        self.B, self.G, self.eta = B, G, eta
        self.gate = AdmissionGate(B, eta, TIMEOUT, prompt_fn=lambda i: {"index": i})
        self.replay = ReplayBuffer(G)
        self.version = 0  # the learner's: optimizer steps done
        self.generator_versions = [0] * generators
        self.now = 0.0
        self.pending = []  # (group_id, prompt_index, sample_index, lease_version) of running episodes
        self.delivered = []  # trajectories already added, to resend as duplicates
        self.expired = set()  # group ids whose lease expired
        self.consumed, self.retired = set(), set()  # prompt indices

    # One rule choosing among the events, rather than one rule per event: Hypothesis' swarm testing
    # would switch whole rules off per example, and few runs would get past the first training steps.
    EVENTS = ["generator_acts", "episodes_finish", "training_step", "clock_advances"]

    @rule(data=st.data(), event=st.sampled_from(EVENTS))
    def next_event(self, data, event):
        getattr(self, event)(data)

    def generator_acts(self, data):
        """A generator maybe applies newer weights (never newer than the learner's), then leases."""
        max_groups = data.draw(st.integers(0, 4))
        i = data.draw(st.integers(0, len(self.generator_versions) - 1))
        newer = st.just(self.version) | st.integers(self.generator_versions[i], self.version)
        u = self.generator_versions[i] = data.draw(newer)
        started = self.gate.groups_started
        leases = self.gate.lease(u, max_groups, self.now, generator_id=i)
        limit = (u + self.eta + 1) * self.B
        assert not leases or started + len(leases) <= limit  # the admission gate
        assert len(leases) == min(max_groups, max(0, limit - started))  # and no stricter than that
        for lease in leases:
            self.replay.open(lease.group_id, lease.prompt_index, u)
            self.pending += [(lease.group_id, lease.prompt_index, s, u) for s in range(self.G)]

    def episodes_finish(self, data):
        """Some running episodes finish, in random order; sometimes a delivered one arrives again."""
        for _ in range(data.draw(st.integers(0, len(self.pending)))):
            self._finish_one(data)
        if self.delivered and data.draw(st.integers(0, 3)) == 0:
            ready = dict(self.replay.ready)
            assert self.replay.add(data.draw(st.sampled_from(self.delivered))) in (DUPLICATE, STRAGGLER)
            assert self.replay.ready == ready

    def _finish_one(self, data):
        # counted from the newest: draws lean towards small numbers, so old episodes linger (long tails)
        k = len(self.pending) - 1 - data.draw(st.integers(0, len(self.pending) - 1))
        group_id, prompt_index, sample_index, lease_version = self.pending.pop(k)
        versions = data.draw(st.lists(st.integers(lease_version, self.version), max_size=3))
        trajectory = make_trajectory(group_id, prompt_index, sample_index, sorted(versions))
        outcome = self.replay.add(trajectory)
        if group_id in self.expired:
            assert outcome == STRAGGLER
            return
        assert outcome in (ADDED, COMPLETED)
        self.delivered.append(trajectory)
        if outcome == COMPLETED:
            self.gate.complete(group_id)

    def training_step(self, data):
        """Sometimes a filter drops a ready group first (DAPO dynamic sampling: the prompt is retired)."""
        if self.replay.ready and data.draw(st.integers(0, 4)) == 0:
            group_id = data.draw(st.sampled_from(sorted(self.replay.ready)))
            self.retired.add(self.replay.ready[group_id].prompt_index)
            self.replay.close(group_id)
            self.gate.release(group_id, reissue=False)
        self._step()

    def clock_advances(self, data):
        self.now += data.draw(st.sampled_from([1.0, 2.0, 5.0]))  # a lease expires after a few of these
        for group_id in self.gate.expire(self.now):
            self.replay.close(group_id)
            self.expired.add(group_id)

    def _step(self) -> bool:
        t = self.version
        groups, dropped = self.replay.take(t, self.B, self.eta)
        for group in dropped:
            assert t - group.version > self.eta
            self.gate.release(group.group_id, reissue=True)
        for group in groups:
            assert len(group.trajectories) == self.G
            for trajectory in group.trajectories:
                assert trajectory.version < 0 or t - trajectory.version <= self.eta  # the consumption check
            assert group.prompt_index not in self.consumed  # never double-consumed
            self.consumed.add(group.prompt_index)
            self.gate.consume(group.group_id)
        assert len(groups) in (0, self.B)
        self.version += bool(groups)
        return bool(groups)

    @invariant()
    def every_prompt_is_in_exactly_one_place(self):
        frontier = self.gate.frontier()
        places = list(frontier["live"].values()) + frontier["reissue"] + list(self.consumed) + list(self.retired)
        assert len(places) == len(set(places))
        assert set(places) == set(range(frontier["next_index"]))
        assert self.gate.groups_started == len(frontier["live"]) + len(self.consumed)
        live = self.gate.live
        assert set(self.replay.open_groups) == {g for g, lease in live.items() if not lease.complete}
        assert set(self.replay.ready) == {g for g, lease in live.items() if lease.complete}

    def teardown(self):
        """Liveness: once every generator holds the learner's weights, training steps again within two
        rounds of lease-all / finish-all (stale buffered groups are dropped and their slots reused)."""
        if not hasattr(self, "gate"):
            return
        for _ in range(2):
            for i in range(len(self.generator_versions)):
                self.generator_versions[i] = self.version
                for lease in self.gate.lease(self.version, 100, self.now, i):
                    self.replay.open(lease.group_id, lease.prompt_index, lease.version)
                    self.pending += [(lease.group_id, lease.prompt_index, s, self.version) for s in range(self.G)]
            for group_id, prompt_index, sample_index, _ in self.pending:
                trajectory = make_trajectory(group_id, prompt_index, sample_index, [self.version])
                if self.replay.add(trajectory) == COMPLETED:
                    self.gate.complete(group_id)
            self.pending = []
            if self._step():
                return
        raise AssertionError("no training step possible: the gate and the learner wait on each other")


GateAndReplay.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
test_gate_and_replay_properties = GateAndReplay.TestCase
