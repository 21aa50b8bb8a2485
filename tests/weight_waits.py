"""Blocking waits on the weight channel for tests: the package itself only polls (generators apply the
newest version between decode steps, never wait for one), so these live beside the tests."""

import time

from nanoverl_async.wire.weights import WeightPublisher, WeightSubscriber

POLL_S = 0.005


def wait_newest(subscriber: WeightSubscriber, current_version: int, timeout_s: float):
    """(version, state_dict) of the next whole version above current_version, its buckets' tensors copied out
    (a bucket's own stay valid only until the next poll); TimeoutError after timeout_s."""
    deadline, state_dict = time.monotonic() + timeout_s, {}
    while True:
        bucket = subscriber.poll_bucket(current_version)
        if bucket is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no weights newer than version {current_version} within {timeout_s} s")
            time.sleep(POLL_S)
            continue
        if bucket.index == 0:  # a version starts (a newer one replaces one not complete)
            state_dict = {}
        state_dict.update({name: tensor.clone() for name, tensor in bucket.tensors.items()})
        if bucket.index == bucket.count - 1:
            return bucket.version, state_dict


def wait_subscribed(publisher: WeightPublisher, subscriptions: int, timeout_s: float) -> None:
    """Until the publisher has seen `subscriptions` subscriptions: a version published then reaches each
    subscriber from its first bucket (one that joins while a version is on its way sees a gap first)."""
    deadline = time.monotonic() + timeout_s
    while publisher.counts["subscriptions"] < subscriptions:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{subscriptions} subscriptions not seen within {timeout_s} s")
        time.sleep(POLL_S)


def wait_sent(publisher: WeightPublisher, version: int, timeout_s: float) -> None:
    """Until `version` (or newer) is on the wire; TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while publisher.sent_version < version:
        assert publisher.error is None, publisher.error
        if time.monotonic() > deadline:
            raise TimeoutError(f"weights version {version} not sent within {timeout_s} s")
        time.sleep(POLL_S)
