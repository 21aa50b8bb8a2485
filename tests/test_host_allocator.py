"""models/host_allocator.py: the heap policy a CPU role sets, by the parameters it trains, exactly at
the boundary; what each policy does to a real process on glibc (a small model's repeated step faults no pages
in again; a large model's freed blocks leave the resident set); and that a learner rank and an engine set it.

Run alone: `python -m pytest tests/test_host_allocator.py -q`.
"""

import subprocess
import sys
from functools import partial

import pytest
import torch
from test_fsdp import free_port, model_dir, setup  # noqa: F401 (model_dir: a fixture)

from nanoverl_async.generators import model_runner
from nanoverl_async.generators.model_runner import ModelRunner
from nanoverl_async.learners import fsdp_rank
from nanoverl_async.learners.fsdp_rank import LearnerRank
from nanoverl_async.models import host_allocator
from nanoverl_async.models.host_allocator import (KEPT_BLOCK_BYTES, KEPT_TOP_BYTES, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD,
                                                  MAPPED_BLOCK_BYTES, MAPPED_FROM_PARAMETERS, tune_host_allocator)

CPU = torch.device("cpu")


class FakeLibc:
    """ctypes.CDLL's stand-in: records mallopt's calls and answers `answer` (glibc: 1 on success)."""
    calls: list = []

    def __init__(self, name: str, answer: int = 1):
        self.answer = answer

    def mallopt(self, option: int, value: int) -> int:
        FakeLibc.calls.append((option, value))
        return self.answer


def test_the_policy_follows_the_parameter_count_exactly_at_its_boundary(monkeypatch):
    """Training fewer than MAPPED_FROM_PARAMETERS (one below included), or none (an engine), the heap keeps blocks
    up to 32 MiB and a free top up to 1 GiB; training that many or more, blocks of 1 MiB and more are mapped and
    the top trimmed past 1 MiB; on a GPU, nothing is set; a C library that refuses a value, or is not glibc,
    leaves ""."""
    monkeypatch.setattr(host_allocator.ctypes, "CDLL", FakeLibc)
    FakeLibc.calls = []
    assert tune_host_allocator(CPU, MAPPED_FROM_PARAMETERS - 1) == "kept"
    assert FakeLibc.calls == [(M_MMAP_THRESHOLD, KEPT_BLOCK_BYTES), (M_TRIM_THRESHOLD, KEPT_TOP_BYTES)]
    assert (KEPT_BLOCK_BYTES, KEPT_TOP_BYTES) == (2**25, 2**30)
    FakeLibc.calls = []
    assert tune_host_allocator(CPU) == "kept"  # an engine's, whatever its model
    assert FakeLibc.calls == [(M_MMAP_THRESHOLD, KEPT_BLOCK_BYTES), (M_TRIM_THRESHOLD, KEPT_TOP_BYTES)]
    FakeLibc.calls = []
    assert tune_host_allocator(CPU, MAPPED_FROM_PARAMETERS) == "mapped"
    assert FakeLibc.calls == [(M_MMAP_THRESHOLD, MAPPED_BLOCK_BYTES), (M_TRIM_THRESHOLD, MAPPED_BLOCK_BYTES)]
    FakeLibc.calls = []
    assert tune_host_allocator(torch.device("cuda")) == "" and FakeLibc.calls == []
    assert tune_host_allocator(torch.device("cuda"), MAPPED_FROM_PARAMETERS) == "" and FakeLibc.calls == []
    monkeypatch.setattr(host_allocator.ctypes, "CDLL", partial(FakeLibc, answer=0))
    assert tune_host_allocator(CPU) == "" and tune_host_allocator(CPU, MAPPED_FROM_PARAMETERS) == ""
    monkeypatch.undo()
    assert tune_host_allocator(CPU, 1, "libnot-a-c-library.so") == ""


# In a fresh process: the policy of a role training argv[1] parameters, then eight "steps" of ten 4 MiB tensors
# alive at once and then freed (an update's activations); prints the policy, each step's page faults, and how much of
# a freed 8 MiB tensor left the resident set.
PROBE = """
import resource, sys, torch
from nanoverl_async.models.host_allocator import tune_host_allocator
policy = tune_host_allocator(torch.device("cpu"), int(sys.argv[1]))
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096
steps = []
for _ in range(8):
    before = faults()
    blocks = [torch.ones(2**20) for _ in range(10)]
    del blocks
    steps.append(faults() - before)
big = torch.ones(2**21); held = rss(); del big
print(policy, held - rss(), *steps)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt, /proc")
def test_a_small_model_keeps_its_steps_blocks_and_a_large_one_hands_them_back():
    """"kept": once the heap holds a step's blocks (by the fourth step), a step faults no page in again, and a
    freed 8 MiB tensor stays in the heap; "mapped": every step maps its ten 4 MiB blocks anew (at least 90% of
    their 10,240 pages faulted each time), and a freed 8 MiB tensor's pages leave the resident set at once."""
    seen = {}
    for parameters in (1, MAPPED_FROM_PARAMETERS):
        out = subprocess.run([sys.executable, "-c", PROBE, str(parameters)], capture_output=True, text=True,
                             check=True).stdout.split()
        seen[out[0]] = (int(out[1]), [int(count) for count in out[2:]])
    kept_returned, kept_steps = seen["kept"]
    mapped_returned, mapped_steps = seen["mapped"]
    pages = 10 * 2**22 // 4096
    assert all(count <= pages // 100 for count in kept_steps[3:]), kept_steps
    assert kept_returned < 2**20
    assert all(count >= 0.9 * pages for count in mapped_steps), mapped_steps
    assert mapped_returned >= 8 * 2**20 - 2**16


def test_a_learner_rank_and_an_engine_set_the_policy_of_what_they_train(monkeypatch, model_dir):
    """Each role calls tune_host_allocator once it holds its model: a learner rank with the parameters it trains,
    an engine with none (it trains nothing)."""
    calls = []
    record = lambda device, parameters=0: calls.append((parameters, device.type)) or "kept"  # noqa: E731
    monkeypatch.setattr(fsdp_rank, "tune_host_allocator", record)
    monkeypatch.setattr(model_runner, "tune_host_allocator", record)
    learner = LearnerRank(setup(model_dir), 0, "127.0.0.1", free_port())
    try:
        expected = sum(parameter.numel() for parameter in learner.model.parameters())
    finally:
        learner.shutdown()
    ModelRunner(model_dir, "cpu", "float32", seed=0, rows=4, block_size=16, num_blocks=8)
    assert calls == [(expected, "cpu"), (0, "cpu")]
