"""The buffer service over real ZeroMQ sockets on 127.0.0.1 (no Ray): leases, trajectories, a corrupt
message and malformed requests (dropped, counted, the service keeps running), batches and their stats,
the consumption check (the oldest versions first, whatever completed first), DAPO's group filter (slot back,
prompt never re-issued) and lease expiry through the service, a clear TimeoutError, a prompt close(), and
every bound at the door exact at its edge (length, vocabulary, versions, max_groups; the model's positions
at start)."""

import itertools
import time

import msgpack
import numpy as np
import pytest
import zmq

from nanoverl_async.buffer.generator_time import GatedClock, TokenRate, WorkShares
from nanoverl_async.buffer.service import BufferService, parse_request
from nanoverl_async.agents.data import prompt_source
from nanoverl_async.agents import multiply_task
from nanoverl_async.config import BufferConfig, ConfigError, DataConfig, GeneratorConfig
from nanoverl_async.observe.metrics import step_metrics
from nanoverl_async.models.load import check_positions
from nanoverl_async.wire.trajectory import Trajectory, encode

_ids = itertools.count()
VOCAB = 110  # the services' model vocabulary: token ids 0..109


def make_trajectory(lease, sample_index, token_versions, generator_id=7) -> Trajectory:
    versions = np.array([-1, -1] + list(token_versions) + [-1], dtype=np.int32)  # prompt, turn, tool token
    mask = (versions >= 0).astype(np.uint8)
    return Trajectory(id=f"t{next(_ids)}", group_id=lease["group_id"], prompt_index=lease["prompt_index"],
                      sample_index=sample_index, token_ids=np.arange(len(versions), dtype=np.int32),
                      loss_mask=mask, behaviour_logprobs=-0.5 * mask.astype(np.float32), versions=versions,
                      reward=float(sample_index), num_turns=2, tool_calls=1, generator_id=generator_id)


class Client:
    """What a generator holds: a PUSH socket for trajectories and a DEALER socket for leases."""

    def __init__(self, endpoints):
        self.context = zmq.Context()
        self.push = self.context.socket(zmq.PUSH)
        self.push.connect(endpoints["trajectories"])
        self.dealer = self.context.socket(zmq.DEALER)
        self.dealer.connect(endpoints["leases"])

    def ask(self, request) -> dict:
        self.dealer.send(request if isinstance(request, bytes) else msgpack.packb(request))
        assert self.dealer.poll(5000), "no reply from the buffer service"
        return msgpack.unpackb(self.dealer.recv(), raw=False)

    def lease(self, version, max_groups, generator_id=7) -> list:
        reply = self.ask({"op": "lease", "generator_id": generator_id, "version": version, "max_groups": max_groups})
        return reply["leases"]

    def close(self):
        self.push.close(linger=0)
        self.dealer.close(linger=0)
        self.context.term()


@pytest.fixture
def make_service():
    made = []

    def make(B, G, eta, lease_timeout_s=30.0, replicas=8, max_groups_in_flight=16, max_tokens=None,
             group_filter=False):
        service = BufferService(B, G, eta, BufferConfig(lease_timeout_s=lease_timeout_s), "127.0.0.1",
                                GeneratorConfig(replicas=replicas, max_groups_in_flight=max_groups_in_flight),
                                VOCAB, lambda index: {"index": index, "question": f"{index}*3?"},
                                group_filter=group_filter, max_tokens=max_tokens)
        client = Client(service.endpoints)
        made.append((service, client))
        return service, client

    yield make
    for service, client in made:
        client.close()
        service.close()


def wait_for(service, condition, timeout_s=5.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not condition(stats := service.stats()):
        assert time.monotonic() < deadline, f"condition not reached; stats {stats}"
        time.sleep(0.01)
    return stats


def test_batches_counters_and_bad_input(make_service):
    service, client = make_service(B=2, G=2, eta=1)
    assert service.endpoints["trajectories"].startswith("tcp://127.0.0.1:")
    assert "msgpack" in client.ask(b"\xc1 not msgpack")["error"]
    assert "max_groups" in client.ask({"op": "lease", "generator_id": 7, "version": 0})["error"]
    assert client.ask({"op": "report", "generator_id": 3, "version": 0}) == {"ok": True}
    leases = client.lease(version=0, max_groups=10)
    assert len(leases) == 4  # (0 + eta + 1) * B slots
    assert [l["sample"]["index"] for l in leases] == [l["prompt_index"] for l in leases] == [0, 1, 2, 3]
    assert client.lease(version=0, max_groups=1) == []  # the gate is closed at version 0

    client.push.send(b"\x00 corrupt trajectory")
    for lease in leases[:2]:
        for sample_index in (1, 0):
            client.push.send(encode(make_trajectory(lease, sample_index, [0, 0])))
    client.push.send(encode(make_trajectory(leases[2], 0, [0])))  # group 2 stays incomplete
    client.push.send(encode(make_trajectory(leases[0], 0, [0, 0])))  # duplicate in a complete group
    client.push.send(encode(make_trajectory(leases[2], 0, [0])))  # duplicate in an incomplete group
    client.push.send(encode(make_trajectory({"group_id": 999, "prompt_index": 0}, 0, [0])))  # straggler
    wait_for(service, lambda s: s["dropped_stragglers"] == 1)

    batch = service.next_batch(version=1, timeout_s=5.0)
    assert [(t.group_id, t.sample_index) for t in batch.trajectories] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    stats = batch.stats
    assert stats["staleness_hist"] == {1: 4} and stats["staleness_token_hist"] == {1: 8}
    assert stats["staleness_mean"] == 1.0 and stats["staleness_max"] == 1
    assert stats["malformed"] == 1 and stats["malformed_requests"] == 2
    assert stats["dropped_duplicates"] == 2 and stats["dropped_stragglers"] == 1 and stats["dropped_stale"] == 0
    assert stats["groups_in_flight"] == 2 and stats["groups_ready"] == 0
    assert stats["generator_versions"] == {3: 0, 7: 0}
    assert stats["tokens_generated"] == 2 * 4 + 1 + 2 + 1 + 1  # everything that arrived and decoded
    assert stats["turns_mean"] == 2.0 and stats["tool_calls_mean"] == 1.0 and stats["reward_mean"] == 0.5
    assert stats["consumed"] == 2 and stats["leased"] == 4

    with pytest.raises(TimeoutError, match=r"step 3 .*version >= 1; 0 ready, 2 in flight"):  # the update of v2
        service.next_batch(version=2, timeout_s=0.2)
    assert service.stats()["tokens_generated"] == 0
    started = time.monotonic()
    service.close()
    assert time.monotonic() - started < 1.0


def test_stale_group_is_dropped_and_its_prompt_reissued(make_service):
    service, client = make_service(B=1, G=1, eta=0)
    (lease,) = client.lease(version=0, max_groups=5)
    client.push.send(encode(make_trajectory(lease, 0, [0])))
    wait_for(service, lambda s: s["groups_ready"] == 1)
    with pytest.raises(TimeoutError):
        service.next_batch(version=1, timeout_s=0.1)  # version 0 is too old to update version 1 with eta = 0
    stats = service.stats()
    assert stats["dropped_stale"] == 1 and stats["released"] == 1 and stats["reissued"] == 1
    assert stats["groups_started"] == 0 and stats["groups_ready"] == 0
    service.publishing(1)
    (again,) = client.lease(version=1, max_groups=1)
    assert again["prompt_index"] == lease["prompt_index"] and again["group_id"] != lease["group_id"]
    client.push.send(encode(make_trajectory(again, 0, [1])))
    assert service.next_batch(version=1, timeout_s=5.0).trajectories[0].group_id == again["group_id"]


def test_a_batch_holds_the_oldest_versions_whatever_completed_first(make_service):
    """Four groups whose completion, lease and version orders all differ: group 0 (leased at version 0, its
    tokens sampled by version 2) completes first, then 3, 2 and 1 (leased at version 1, tokens of version 1).
    The first batch of 2 is the oldest by version (1), the earlier completed first among equals: groups 3 and
    2, in lease order; the next holds 1 and 0. Taking them by completion, by lease version or by group id, or
    the newest first, each changes a batch."""
    service, client = make_service(B=2, G=1, eta=2)
    (first,) = client.lease(version=0, max_groups=1)
    service.publishing(1)
    leases = [first] + client.lease(version=1, max_groups=3)
    assert [lease["group_id"] for lease in leases] == [0, 1, 2, 3]
    service.publishing(2)
    for group_id, versions in ((0, [2, 2]), (3, [1]), (2, [1, 2]), (1, [1, 1])):  # the order they complete in
        client.push.send(encode(make_trajectory(leases[group_id], 0, versions)))
    wait_for(service, lambda s: s["groups_ready"] == 4)
    batches = [service.next_batch(version=2, timeout_s=5.0) for _ in range(2)]
    assert [[t.group_id for t in batch.trajectories] for batch in batches] == [[2, 3], [1, 0]]
    assert [batch.stats["staleness_hist"] for batch in batches] == [{1: 2}, {1: 1, 0: 1}]


def test_a_filtered_group_gives_its_slot_back_and_its_prompt_is_never_reissued(make_service):
    """DAPO dynamic sampling through the service: a group of 3 whose rewards all tie is dropped as it completes;
    its slot goes back (the gate, B=1 and eta=0, leases the next prompt at once) but never its prompt: the next
    leases are prompts 1, then 2, and a late trajectory of the dropped group is a straggler. Rewards that tie
    in two samples of three keep a group."""
    service, client = make_service(B=1, G=3, eta=0, group_filter=True)
    (tied,) = client.lease(version=0, max_groups=2)
    for sample_index in range(3):
        trajectory = make_trajectory(tied, sample_index, [0])
        trajectory.reward = 1.0
        client.push.send(encode(trajectory))
    stats = wait_for(service, lambda s: s["dropped_filtered"] == 1)
    assert (stats["released"], stats["reissued"], stats["groups_started"], stats["groups_ready"]) == (1, 0, 0, 0)
    (kept,) = client.lease(version=0, max_groups=2)
    assert kept["prompt_index"] == 1 and service.gate.frontier() == {"next_index": 2, "reissue": [],
                                                                     "live": {kept["group_id"]: 1}}
    client.push.send(encode(make_trajectory(tied, 0, [0])))  # a late copy of the filtered group: a straggler
    for sample_index, reward in enumerate((1.0, 1.0, 0.0)):
        trajectory = make_trajectory(kept, sample_index, [0])
        trajectory.reward = reward
        client.push.send(encode(trajectory))
    batch = service.next_batch(version=0, timeout_s=5.0)
    assert [t.prompt_index for t in batch.trajectories] == [1, 1, 1] and batch.stats["dropped_filtered"] == 1
    assert batch.stats["dropped_stragglers"] == 1
    service.publishing(1)
    assert [lease["prompt_index"] for lease in client.lease(version=1, max_groups=2)] == [2]


def test_expired_lease_is_reissued_and_its_stragglers_dropped(make_service):
    service, client = make_service(B=1, G=2, eta=0, lease_timeout_s=0.2)
    (lease,) = client.lease(version=0, max_groups=1)
    client.push.send(encode(make_trajectory(lease, 0, [0])))
    wait_for(service, lambda s: s["expired"] == 1)
    client.push.send(encode(make_trajectory(lease, 1, [0])))  # the late half of the group
    wait_for(service, lambda s: s["dropped_stragglers"] == 1)
    (again,) = client.lease(version=0, max_groups=1)
    assert again["prompt_index"] == lease["prompt_index"] and again["group_id"] != lease["group_id"]
    assert service.stats()["groups_ready"] == 0


def test_req_clients_work_too(make_service):
    service, _ = make_service(B=1, G=1, eta=0)
    context = zmq.Context()
    req = context.socket(zmq.REQ)
    req.connect(service.endpoints["leases"])
    req.send(msgpack.packb({"op": "report", "generator_id": 1, "version": 0}))
    assert req.poll(5000) and msgpack.unpackb(req.recv()) == {"ok": True}
    req.close(linger=0)
    context.term()


@pytest.mark.parametrize("request_,field", [
    ({"op": "steal", "generator_id": 0, "version": 0}, "op"),
    ({"op": "report", "version": 0}, "generator_id"),
    ({"op": "report", "generator_id": "0", "version": 0}, "generator_id"),
    ({"op": "report", "generator_id": 0, "version": -1}, "version"),
    ({"op": "lease", "generator_id": 0, "version": 0, "max_groups": True}, "max_groups"),
    ({"op": "report", "generator_id": 0, "version": 0, "extra": 1}, "extra"),
    ({"op": "lease", "generator_id": 0, "version": 0, "max_groups": 1, "clock_ms": 0, "busy_ms": -1, "tool_wait_ms": 0},
     "busy_ms"),
    ({"op": "lease", "generator_id": 0, "version": 0, "max_groups": 1, "clock_ms": 0, "busy_ms": 0,
      "tool_wait_ms": 0.5}, "tool_wait_ms"),
    ({"op": "report", "generator_id": 0, "version": 0, "busy_ms": 0}, "busy_ms"),  # a lease's field only
])
def test_parse_request_names_the_bad_field(request_, field):
    with pytest.raises(ValueError, match=f"'{field}'"):
        parse_request(msgpack.packb(request_))


def test_prompt_source_names_builtins_modules_and_files():
    assert prompt_source(DataConfig(task="operator:add"), seed=3)(5) == 8  # module:attr is called as fn(seed, index)
    assert prompt_source(DataConfig(), seed=3)(5) == multiply_task.make_prompt(3, 5)  # builtin:multiply
    with pytest.raises(ValueError, match="form package.module:Name"):
        prompt_source(DataConfig(task="multiply"), seed=0)
    with pytest.raises(ValueError, match="not a built-in data.task; the built-ins are builtin:multiply"):
        prompt_source(DataConfig(task="builtin:add"), seed=0)


def test_gated_clock_counts_refused_generator_time_per_window():
    clock = GatedClock(now=0.0)
    clock.observe(1, refused=True, now=1.0)  # generator 1 refused from t=1 ...
    clock.observe(1, refused=True, now=2.0)  # (still the same spell)
    clock.observe(1, refused=False, now=3.0)  # ... until t=3: 2 s
    clock.observe(2, refused=True, now=6.0)  # generator 2 refused from t=6, still at t=8
    assert clock.fraction(now=8.0, generators=2) == pytest.approx((2 + 2) / (8 * 2))
    clock.observe(2, refused=False, now=9.0)  # the open spell counts from the new window's start
    assert clock.fraction(now=10.0, generators=2) == pytest.approx(1 / (2 * 2))
    assert clock.fraction(now=11.0, generators=2) == 0.0


def test_parse_request_takes_a_leases_clock_at_zero():
    request = {"op": "lease", "generator_id": 0, "version": 0, "max_groups": 1, "clock_ms": 0, "busy_ms": 0,
               "tool_wait_ms": 0}
    assert parse_request(msgpack.packb(request)) == request


def test_work_shares_are_each_windows_reported_milliseconds_over_the_clocks_own():
    shares = WorkShares()
    assert shares.fractions() == {"generators_busy_frac": 0.0, "generators_tool_wait_frac": 0.0}  # nothing yet
    shares.observe(0, {"clock_ms": 2000, "busy_ms": 1000, "tool_wait_ms": 500})
    shares.observe(1, {"clock_ms": 2000, "busy_ms": 1999, "tool_wait_ms": 0})
    shares.observe(1, {"op": "lease"})  # a request without the clock (an older client) changes nothing
    assert shares.fractions() == {"generators_busy_frac": 2999 / 4000, "generators_tool_wait_frac": 500 / 4000}
    shares.observe(0, {"clock_ms": 3000, "busy_ms": 1500, "tool_wait_ms": 1000})  # only what came since counts
    assert shares.fractions() == {"generators_busy_frac": 0.5, "generators_tool_wait_frac": 0.5}
    shares.observe(0, {"clock_ms": 3010, "busy_ms": 1511, "tool_wait_ms": 1000})  # 11 ms of 10: rounding, at most 1
    assert shares.fractions() == {"generators_busy_frac": 1.0, "generators_tool_wait_frac": 0.0}
    assert shares.fractions() == {"generators_busy_frac": 0.0, "generators_tool_wait_frac": 0.0}


def test_the_token_rate_spans_the_latest_windows_so_a_window_without_arrivals_is_not_0():
    rate = TokenRate(windows=3)
    assert rate.rate(now=1.0) == 0.0  # no lease yet: nothing was generated, over no time
    rate.start(now=2.0)  # the first lease: the window starts here
    rate.start(now=2.5)  # (later leases change nothing)
    rate.tokens += 300
    assert rate.rate(now=5.0) == 100.0  # 300 tokens over 2..5
    assert rate.rate(now=6.0) == 75.0  # a window with none: 300 over 2..6, not 0
    rate.tokens += 100
    assert rate.rate(now=8.0) == pytest.approx(400 / 6)  # 2..8: three windows
    assert rate.rate(now=9.0) == 100 / 4  # the oldest window left: 5..9
    assert rate.rate(now=10.0) == 100 / 4  # 6..10
    assert rate.rate(now=11.0) == 0.0  # three windows without a token: 0, truly


def test_a_batch_that_was_ready_at_once_reports_the_rate_generation_delivered(make_service):
    """The live line's `0 tok/s`: two groups done before the first batch, so the second batch's window received
    no token while the generators went on."""
    service, client = make_service(B=1, G=1, eta=1, replicas=1)
    for lease in client.lease(version=0, max_groups=2, generator_id=0):
        client.push.send(encode(make_trajectory(lease, 0, [0, 0, 0])))
    wait_for(service, lambda s: s["completed"] == 2)
    first = service.next_batch(0, timeout_s=5).stats
    batch = service.next_batch(1, timeout_s=5)
    second = batch.stats
    assert first["tokens_generated"] == 6 and second["tokens_generated"] == 0
    assert 0 < second["tokens_per_s"] <= first["tokens_per_s"]  # the same 6 tokens, over both windows
    logged = step_metrics(1, 1, batch, {}, step_seconds=0.01, samples_trained=2)
    assert logged["tokens/generated_per_s"] == second["tokens_per_s"] and "buffer/tokens_per_s" not in logged


def test_a_generators_clock_reaches_the_batch_stats(make_service):
    service, client = make_service(B=1, G=1, eta=0, replicas=1)
    reply = client.ask({"op": "lease", "generator_id": 0, "version": 0, "max_groups": 1, "clock_ms": 400,
                        "busy_ms": 300, "tool_wait_ms": 100})
    client.push.send(encode(make_trajectory(reply["leases"][0], 0, [0])))
    batch = service.next_batch(0, timeout_s=5)
    assert (batch.stats["generators_busy_frac"], batch.stats["generators_tool_wait_frac"]) == (0.75, 0.25)


def test_refused_leases_show_up_as_gated_time(make_service):
    service, client = make_service(B=1, G=1, eta=0, replicas=1)
    (lease,) = client.lease(version=0, max_groups=2, generator_id=0)  # version 0 may start B=1 group
    assert client.lease(version=0, max_groups=2, generator_id=0) == []  # then the staleness bound refuses it
    time.sleep(0.3)
    client.push.send(encode(make_trajectory(lease, 0, [0])))
    batch = service.next_batch(0, timeout_s=5)
    assert 0.1 < batch.stats["generators_gated_frac"] <= 1.0


def test_trajectories_the_run_cannot_have_produced_are_malformed(make_service):
    """Ids beyond the vocabulary, versions never published or going backwards: dropped and counted before
    they reach a group (the learner would fail on the first, train the second as negative staleness)."""
    service, client = make_service(B=1, G=2, eta=0)
    (lease,) = client.lease(version=0, max_groups=1)
    beyond_vocab = make_trajectory(lease, 0, [0, 0])
    beyond_vocab.token_ids = np.full_like(beyond_vocab.token_ids, 5000)
    backwards = make_trajectory(lease, 0, [1, 0])
    for bad in (beyond_vocab, make_trajectory(lease, 0, [0, 1000]), backwards):
        client.push.send(encode(bad))
    wait_for(service, lambda s: s["malformed"] == 3)
    assert service.stats()["groups_ready"] == 0
    for sample_index in (0, 1):  # the run goes on: the group completes with honest trajectories
        client.push.send(encode(make_trajectory(lease, sample_index, [0, 0])))
    batch = service.next_batch(version=0, timeout_s=5.0)
    assert batch.stats["staleness_hist"] == {0: 2} and batch.stats["malformed"] == 3
    service.publishing(1)  # once published, version 1 is honest
    (lease,) = client.lease(version=1, max_groups=1)
    for sample_index in (0, 1):
        client.push.send(encode(make_trajectory(lease, sample_index, [1, 1])))
    assert service.next_batch(version=1, timeout_s=5.0).stats["malformed"] == 3


def test_a_group_takes_each_trajectory_id_once(make_service):
    service, client = make_service(B=1, G=2, eta=0)
    (lease,) = client.lease(version=0, max_groups=1)
    first = make_trajectory(lease, 0, [0])
    copy = make_trajectory(lease, 1, [0])
    copy.id = first.id  # the same episode again, posing as the group's second sample
    client.push.send(encode(first))
    client.push.send(encode(copy))
    wait_for(service, lambda s: s["dropped_duplicates"] == 1)
    assert service.stats()["groups_ready"] == 0


def test_lease_requests_are_checked_against_what_the_buffer_knows(make_service):
    """A peer claiming unpublished weights, a generator the run does not have, or more groups than a
    generator may hold is refused and counted, each at the exact edge (version == newest and max_groups ==
    generator.max_groups_in_flight pass, one more does not); a refusal never names the newest version; the
    versions the buffer reports stay those of the run's generators."""
    service, client = make_service(B=4, G=1, eta=2, replicas=2, max_groups_in_flight=3)
    service.publishing(7)
    claims = [((10**6, 1, 0), "field 'version': 1000000 was never published"),
              ((8, 1, 1), "field 'version': 8 was never published"),
              ((0, 1, 2), "field 'generator_id': 2 is not one of this run's 2"),
              ((7, 4, 0), "field 'max_groups': 4 is more than a generator may hold (generator.max_groups_in_flight=3)"),
              ((7, 2**63, 0), f"field 'max_groups': {2**63} is more")]
    for (version, max_groups, generator_id), error in claims:
        refusal = client.ask({"op": "lease", "version": version, "max_groups": max_groups,
                              "generator_id": generator_id})["error"]
        assert refusal.startswith(error) and "7" not in refusal.replace(str(max_groups), "")  # newest: not named
    refusal = client.ask({"op": "report", "generator_id": 0, "version": 8})["error"]
    assert refusal == "field 'version': 8 was never published"
    assert service.stats()["leased"] == 0
    assert len(client.lease(version=7, max_groups=3, generator_id=0)) == 3  # the newest version, the whole share
    assert client.lease(version=7, max_groups=3, generator_id=0) == []  # its 3 are still in flight
    assert len(client.lease(version=7, max_groups=1, generator_id=1)) == 1  # the gate had room for others
    stats = service.stats()
    assert stats["malformed_requests"] == 6 and stats["oversized_leases"] == 2 and stats["leased"] == 4
    assert stats["generator_versions"] == {0: 7, 1: 7}


def test_trajectory_bounds_hold_at_their_exact_edges(make_service):
    """max_tokens (agent.max_total_tokens) tokens pass, one more is dropped and counted as too_long; id
    VOCAB - 1 passes, VOCAB does not; a token of the newest version passes, of newest + 1 does not. The
    counters reach the step's metrics as buffer/too_long and buffer/malformed."""
    service, client = make_service(B=1, G=3, eta=0, max_tokens=7)
    service.publishing(1)
    (lease,) = client.lease(version=1, max_groups=1)
    longest = make_trajectory(lease, 0, [1, 1, 1, 1])  # 2 prompt + 4 sampled + 1 tool token = 7
    too_long = make_trajectory(lease, 0, [1, 1, 1, 1, 1])
    last_id, beyond_vocab = make_trajectory(lease, 1, [1]), make_trajectory(lease, 1, [1])
    last_id.token_ids[0], beyond_vocab.token_ids[0] = VOCAB - 1, VOCAB
    for bad in (too_long, beyond_vocab, make_trajectory(lease, 2, [1, 2])):
        client.push.send(encode(bad))
    wait_for(service, lambda s: s["malformed"] == 3)
    assert service.stats()["too_long"] == 1 and service.stats()["tokens_generated"] == 0
    for good in (longest, last_id, make_trajectory(lease, 2, [1, 1])):
        client.push.send(encode(good))
    batch = service.next_batch(version=1, timeout_s=5.0)
    assert [len(t.token_ids) for t in batch.trajectories] == [7, 4, 5]
    metrics = step_metrics(1, 0, batch, {}, 1.0, 3)
    assert metrics["buffer/too_long"] == 1 and metrics["buffer/malformed"] == 3
    assert metrics["buffer/oversized_leases"] == 0


def test_a_run_longer_than_the_models_positions_is_refused_at_start(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 256, "vocab_size": 110}')
    check_positions(str(tmp_path), max_total_tokens=256)
    with pytest.raises(ConfigError, match="'agent.max_total_tokens': 257 is more than the model's 256 positions"):
        check_positions(str(tmp_path), max_total_tokens=257)
