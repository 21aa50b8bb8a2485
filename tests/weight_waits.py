"""Blocking waits on the weight channel for tests: the package itself only polls (generators apply the
newest version between decode steps, never wait for one), so these live beside the tests."""

import time

from nanoverl_async.wire.weights import WeightPublisher, WeightSubscriber

POLL_S = 0.005


def wait_newest(subscriber: WeightSubscriber, current_version: int, timeout_s: float):
    """(version, state_dict) of the newest version above current_version; TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while (newest := subscriber.poll_newest(current_version)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no weights newer than version {current_version} within {timeout_s} s")
        time.sleep(POLL_S)
    return newest


def wait_sent(publisher: WeightPublisher, version: int, timeout_s: float) -> None:
    """Until `version` (or newer) is on the wire; TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while publisher.sent_version < version:
        assert publisher.error is None, publisher.error
        if time.monotonic() > deadline:
            raise TimeoutError(f"weights version {version} not sent within {timeout_s} s")
        time.sleep(POLL_S)
