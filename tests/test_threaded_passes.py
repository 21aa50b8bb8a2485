"""learner.micro_batch_threads: micro-batches trained at once, on threads of one process, train as one pass does,
and the same every time.

The same tiny random Qwen2 as tests/test_fsdp.py, one rank. Threads split a micro-batch's rows in two, so the
packed layouts differ from one pass's and sums round differently: the results agree to float32 tolerance; two
threaded runs agree bit for bit (each thread sums its own gradients, added in thread order).
"""

import dataclasses
import threading

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from nanoverl_async.config import ConfigError, KLConfig, LearnerConfig, ModelConfig, load_config
from nanoverl_async.learners.batch import collate, with_advantages
from nanoverl_async.learners.fsdp_rank import LearnerRank
from nanoverl_async.learners.packing import pack, prompt_lengths
from nanoverl_async.learners.setup import LearnerSetup
from nanoverl_async.learners.threaded_passes import ThreadedPasses
from synthetic import episodes
from test_fsdp import ALGO, TEMPERATURE, free_port, write_model_dir

LEARNER = LearnerConfig(lr=1e-3, grad_clip=0.5, torch_threads=1)
METRICS = ("loss", "pg_loss", "grad_norm", "entropy", "clip_fraction", "is_weight_mean", "behaviour_kl")
SHAPES = [[(5, [6, 3], 0.0), (5, [2], 1.0), (3, [7], 1.0), (3, [4, 4], 0.0), (6, [9], 0.0), (6, [1], 1.0)],
          [(3, [4, 2], 1.0), (3, [5], 0.0), (4, [2], 0.0), (4, [1], 1.0), (2, [8, 8], 1.0), (2, [3], 0.0)]]


def batches():
    return [with_advantages(collate(episodes(shape, seed=seed, shared_prompts=True)), 2, ALGO, KLConfig(),
                            max_total_tokens=32) for seed, shape in enumerate(SHAPES)]


def trained(model_dir: str, threads: int, micro_batch_tokens: int = 0) -> tuple[list[dict], dict]:
    """(the metrics of two updates, the weights after them)."""
    learner = dataclasses.replace(LEARNER, micro_batch_threads=threads, micro_batch_tokens=micro_batch_tokens)
    rank = LearnerRank(LearnerSetup(ModelConfig(path=model_dir), learner, ALGO, temperature=TEMPERATURE), 0,
                       "127.0.0.1", free_port())
    try:
        metrics = [rank.update(batch, version) for version, batch in enumerate(batches())]
        return metrics, {name: tensor.detach().clone() for name, tensor in rank.model.state_dict().items()}
    finally:
        rank.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("model"))


@pytest.mark.parametrize("micro_batch_tokens", [0, 40])  # one micro-batch, or several (more than the threads)
def test_threads_train_as_one_pass_does(model_dir, micro_batch_tokens):
    one, one_weights = trained(model_dir, 1, micro_batch_tokens)
    two, weights = trained(model_dir, 2, micro_batch_tokens)
    for step, (ours, theirs) in enumerate(zip(two, one)):
        assert ours["tokens"] == theirs["tokens"], step
        for key in METRICS:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (step, key)
    for name, tensor in weights.items():
        assert torch.allclose(tensor, one_weights[name], atol=1e-5), name  # Adam: m / sqrt(v) amplifies rounding


@pytest.mark.parametrize("micro_batch_tokens", [0, 40])
def test_threaded_runs_are_the_same_bit_for_bit(model_dir, micro_batch_tokens):
    first, first_weights = trained(model_dir, 2, micro_batch_tokens)
    again, weights = trained(model_dir, 2, micro_batch_tokens)
    def results(metrics):  # the peak memory is the process's, whatever the threads
        return [{key: value for key, value in step.items() if not key.startswith("memory/")} for step in metrics]

    assert results(first) == results(again)
    assert all(torch.equal(tensor, first_weights[name]) for name, tensor in weights.items())


def test_a_thread_without_rows_adds_nothing():
    """One row and two threads: one thread gets no range; the gradient is that row's, as without threads."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(3))
    rows = torch.randn(1, 3)

    def loss_of(start, stop):
        loss = (rows[start:stop] @ weight).square().sum()
        return loss, {"loss": loss.detach()}

    metrics = ThreadedPasses(2).accumulate(loss_of, [(0, 1)], [weight])
    expected = torch.autograd.grad(loss_of(0, 1)[0], weight)[0]
    assert len(metrics) == 1 and torch.equal(weight.grad, expected)


def test_packed_forwards_on_two_threads_read_their_own_positions(model_dir):
    """Packing.forward hooks the model's LM head for each call: on two threads at once, each reads its own rows."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    packings = []
    for batch in batches():
        packings.append(pack(batch.input_ids, batch.attention_mask, prompts=prompt_lengths(batch.loss_mask),
                             wanted=batch.loss_mask))
    with torch.no_grad():
        alone = [packing.logprobs(model, TEMPERATURE) for packing in packings]
        together = [None, None]
        start = threading.Barrier(2)

        def run(index):
            start.wait()
            for _ in range(5):  # forwards overlapping many times
                together[index] = packings[index].logprobs(model, TEMPERATURE)

        threads = [threading.Thread(target=run, args=(index,)) for index in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for ours, theirs in zip(together, alone):
        assert torch.equal(ours, theirs)


def sharded(module: torch.nn.Module) -> torch.nn.Module:
    """`module` as FSDP2's fully_shard leaves it, class-wise (its class becomes a subclass of FSDPModule)."""
    module.__class__ = type(f"FSDP{type(module).__name__}", (FSDPModule, type(module)), {})
    return module


@pytest.mark.parametrize("overrides, plain, threads", [
    ([], True, 2),  # the config's, on the plain model one float32 rank gets
    (["learner.micro_batch_threads=1"], True, None),
    (["learner.micro_batch_threads=3"], True, 3),
    ([], False, None),  # several ranks, or bfloat16 compute: the rank built an FSDP2 module
    (["learner.device=cuda"], True, None),
    (["learner.compile=true"], True, None),
    (["learner.lora.rank=8", "learner.lora.dropout=0.1"], True, None),
    (["learner.lora.rank=8", "learner.lora.dropout=0.0"], True, 2),
    (["learner.lora.dropout=0.1"], True, 2),  # dropout without adapters (rank 0) draws nothing: LoRAConfig.drops
])
def test_threads_where_a_plain_cpu_model_trains_without_compile_or_dropout(overrides, plain, threads):
    cfg = load_config("configs/agent_grpo.yaml", overrides)  # never refused: elsewhere one pass at a time
    model = torch.nn.Linear(2, 2)
    passes = ThreadedPasses.where_usable(cfg.learner, model if plain else sharded(model))
    assert (passes.threads if passes else None) == threads


def test_no_threads_is_refused():
    with pytest.raises(ConfigError, match=r"^config key 'learner\.micro_batch_threads': .*must be > 0"):
        load_config("configs/agent_grpo.yaml", ["learner.micro_batch_threads=0"])
