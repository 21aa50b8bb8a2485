"""Shared fixtures: one local Ray instance for every test that places roles in-process."""

import pytest
import ray

from nanoverl_async.config import load_config
from nanoverl_async.launcher import start_ray


@pytest.fixture(scope="session")
def ray_session():
    started = start_ray(load_config(None).ray)
    yield
    if started:
        ray.shutdown()
