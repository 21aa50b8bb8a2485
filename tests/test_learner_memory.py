"""Learner memory (learners/memory.py, packing.chunked_head, learner.activation_checkpointing): the
checkpointed and chunked paths give the plain path's loss and gradients in float32 on 1 and 2 ranks (gloo),
a chunk's logits are not kept for backward, every update reports its memory/* peaks, and the start-up
check fails at the exact byte where the learner's persistent state no longer fits.

Run alone: `python -m pytest tests/test_learner_memory.py -q`.
"""

import dataclasses

import pytest
import torch
import torch.multiprocessing as mp
from test_cli_run import read_metrics
from test_fsdp import ALGO, LEARNER, free_port, make_batch, model_dir, setup  # noqa: F401 (model_dir: a fixture)
from transformers import AutoModelForCausalLM

from nanoverl_async.config import ConfigError, ModelConfig, load_config
from nanoverl_async.learners.fsdp_rank import LearnerRank
from nanoverl_async.learners.memory import GB, learner_fit_error, learner_state_bytes
from nanoverl_async.learners.packing import pack, prompt_lengths
from nanoverl_async.runtime.preflight import check_learner_fits

ENTROPY_ALGO = dataclasses.replace(ALGO, entropy_coef=0.01)  # the entropy's gradient goes through the chunks too
SAVING = {"activation_checkpointing": True, "logits_chunk_tokens": 2}
PLAIN = {"activation_checkpointing": False, "logits_chunk_tokens": 0}


def first_step(rank, world_size, port, model_dir, learner_fields):
    """One update of the batch on `world_size` ranks (micro-batches of one sequence): its metrics and the
    clipped gradient (AdamW's first moment / (1 - beta1) after one step) by parameter name."""
    cfg = dataclasses.replace(LEARNER, micro_batch_tokens=1, **learner_fields)
    learner = LearnerRank(setup(model_dir, ENTROPY_ALGO, cfg, world_size), rank, "127.0.0.1", port)
    try:
        metrics = learner.update(make_batch())
        moments = {}
        for name, param in learner.model.named_parameters():
            moment = learner.optimizer.state[param]["exp_avg"]
            moment = moment.full_tensor() if hasattr(moment, "full_tensor") else moment
            moments[name] = moment / (1 - LEARNER.betas[0])
    finally:
        learner.shutdown()
    return metrics, moments


def worker(rank, ports, model_dir, out_dir):
    results = {}
    for index, (name, fields) in enumerate((("plain", PLAIN), ("saving", SAVING))):
        results[2, name] = first_step(rank, 2, ports[index], model_dir, fields)
        if rank == 0:
            results[1, name] = first_step(0, 1, ports[2 + index], model_dir, fields)
    if rank == 0:
        torch.save(results, f"{out_dir}/results.pt")


def test_checkpointed_and_chunked_paths_give_the_plain_loss_and_gradients_on_one_and_two_ranks(model_dir, tmp_path):
    mp.spawn(worker, args=([free_port() for _ in range(4)], model_dir, str(tmp_path)), nprocs=2, join=True)
    results = torch.load(tmp_path / "results.pt")
    batch = make_batch()
    assert int(batch.loss_mask.sum()) > SAVING["logits_chunk_tokens"]  # several chunks on one rank at least
    for world_size in (1, 2):
        (plain, plain_grads), (saving, saving_grads) = results[world_size, "plain"], results[world_size, "saving"]
        for key in ("loss", "entropy", "grad_norm", "is_weight_mean"):
            assert saving[key] == pytest.approx(plain[key], abs=1e-5), (world_size, key)
        assert plain["grad_norm"] > 0
        for name, gradient in plain_grads.items():
            assert torch.allclose(saving_grads[name], gradient, atol=1e-5), (world_size, name)
        for metrics in (plain, saving):  # a real step's peak memory, the largest of any rank, in GB
            assert 0.05 < metrics["memory/learner_peak_host_gb"] < 64
            # a CPU learner has no device memory of its own
            assert [key for key in metrics if key.startswith("memory/")] == ["memory/learner_peak_host_gb"]


def test_every_step_of_a_real_run_logs_the_learner_peak_memory(observed_run):
    """The CLI's default job (conftest.py's shared run): each line of metrics.jsonl has memory/*, in GB."""
    rows = read_metrics(observed_run)
    assert rows and all(0.05 < row["memory/learner_peak_host_gb"] < 64 for row in rows)


def test_a_chunk_keeps_no_logits_for_backward(model_dir):
    """Under chunks of 3 tokens no tensor of the vocabulary's width is saved for backward (each chunk keeps
    its inputs alone, torch.utils.checkpoint recomputes the rest in backward); without chunks the
    logits at the predicting positions [h, V] are saved."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = make_batch()
    packing = pack(batch.input_ids, batch.attention_mask, prompts=prompt_lengths(batch.loss_mask),
                   wanted=batch.loss_mask)
    vocab = model.config.vocab_size
    weights = {param.untyped_storage().data_ptr() for param in model.parameters()}  # the head's weight is saved too
    for chunk_tokens, saved in ((3, []), (0, [len(packing.outputs)])):  # the head runs where it predicts
        rows = []

        def keep(tensor):
            if tensor.shape[-1] == vocab and tensor.untyped_storage().data_ptr() not in weights:
                rows.append(tensor.shape[0])
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            logprobs, _ = packing.logprobs_and_entropy(model, 0.8, entropy_grad=True, chunk_tokens=chunk_tokens)
        assert sorted(set(rows)) == saved, chunk_tokens
        (logprobs * batch.loss_mask).sum().backward()  # and backward still runs


def test_the_persistent_state_fits_up_to_the_exact_byte():
    # 16 bytes per trained parameter and the frozen weights' bytes, over 2 ranks: 1,000 x 16 + 2,000 = 18,000 / 2
    assert learner_state_bytes(1_000, 2_000, 2) == 9_000
    assert learner_state_bytes(1_001, 0, 2) == 8_008
    assert learner_state_bytes(1, 0, 3) == 6  # rounded up: 16 / 3
    assert learner_fit_error(1_000, 2_000, 2, 9_000, "GPU memory") is None
    refused = learner_fit_error(1_000, 2_000, 2, 8_999, "GPU memory")
    assert refused is not None and "\n" not in refused and "learner.world_size >= 3" in refused
    # CPU ranks on one host: every rank's share lands in the same memory, so more ranks do not help
    assert learner_fit_error(1_000, 0, 4, 16_000, "host memory", ranks_share_it=True) is None
    shared = learner_fit_error(1_000, 0, 4, 15_999, "host memory", ranks_share_it=True)
    assert shared is not None and "world_size" not in shared and "smaller model" in shared
    # a 7B model on one 80 GB GPU: 7.6e9 x 16 = 122 GB
    line = learner_fit_error(7_615_616_512, 0, 1, int(80 * GB), "GPU memory (H100)")
    assert "121.8 GB > 80.0 GB of GPU memory (H100)" in line and "learner.world_size >= 2" in line


def test_launch_refuses_a_learner_that_cannot_fit_before_any_role_starts(model_dir, monkeypatch):
    from nanoverl_async.runtime import preflight

    cfg = load_config(None, [f"model.path={model_dir}", "learner.world_size=2"])
    trained = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    # counted from the config alone: the policy; with KL the reference, frozen; with gae the critic, trained
    assert preflight.learner_parameters(cfg) == (trained, 0)
    assert preflight.learner_parameters(load_config(None, [f"model.path={model_dir}", "kl.loss_coef=0.1"])) == \
        (trained, 4 * trained)
    critic = trained + 64 + 1  # the same body (its tied head was the embedding) and a score head [1, 64] + bias
    assert preflight.learner_parameters(load_config(None, [f"model.path={model_dir}", "algorithm.advantage=gae"])) \
        == (trained + critic, 0)
    assert preflight.learner_parameters(load_config(None, ["model.path=builtin:tiny"])) is None  # not counted
    monkeypatch.setattr(preflight, "learner_memory", lambda cfg: (trained * 16, "host memory"))
    check_learner_fits(cfg)  # 16 bytes x parameters / 2 ranks, shared on one host: exactly fits
    monkeypatch.setattr(preflight, "learner_memory", lambda cfg: (trained * 16 - 1, "host memory"))
    with pytest.raises(ConfigError, match="the learner cannot fit.*host memory"):
        check_learner_fits(cfg)


def saved_for_backward(learner: LearnerRank) -> int:
    """Elements of the tensors one training forward of the policy saves for backward (not its weights)."""
    batch = make_batch()
    packing = pack(batch.input_ids, batch.attention_mask, prompts=prompt_lengths(batch.loss_mask),
                   wanted=batch.loss_mask)
    weights = {shape for param in learner.model.parameters() for shape in (param.shape, param.shape[::-1])}
    sizes = []

    def keep(tensor):
        sizes.append(0 if tensor.shape in weights else tensor.numel())  # a weight (or its transpose) costs nothing
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        packing.logprobs(learner.model, 0.8)
    return sum(sizes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # the plain model; FSDP2 with mixed precision
def test_activation_checkpointing_saves_less_for_backward(model_dir, dtype):
    saved = {}
    for on in (False, True):
        cfg = dataclasses.replace(LEARNER, activation_checkpointing=on)
        learner = LearnerRank(dataclasses.replace(setup(model_dir, learner=cfg), model=ModelConfig(model_dir, dtype)),
                              0, "127.0.0.1", free_port())
        try:
            saved[on] = saved_for_backward(learner)
        finally:
            learner.shutdown()
    assert saved[True] < saved[False] / 2, saved  # each of the 2 layers keeps its input alone


def test_one_bfloat16_fsdp2_rank_trains_the_same_with_memory_saving_on(model_dir):
    """The path a lone GPU learner runs (FSDP2, bfloat16 compute, micro-batches accumulated unsharded): with
    checkpointing and chunks, the same loss and first-step gradient up to bfloat16 rounding."""
    steps = {}
    for name, fields in (("plain", PLAIN), ("saving", SAVING)):
        cfg = dataclasses.replace(LEARNER, micro_batch_tokens=1, **fields)
        bf16 = dataclasses.replace(setup(model_dir, ENTROPY_ALGO, cfg), model=ModelConfig(model_dir, "bfloat16"))
        learner = LearnerRank(bf16, 0, "127.0.0.1", free_port())
        try:
            metrics = learner.update(make_batch())
            state = learner.optimizer.state
            steps[name] = metrics, torch.cat([state[p]["exp_avg"].full_tensor().flatten()
                                              for p in learner.model.parameters()])
        finally:
            learner.shutdown()
    (plain, plain_moments), (saving, saving_moments) = steps["plain"], steps["saving"]
    assert saving["loss"] == pytest.approx(plain["loss"], rel=1e-2, abs=1e-4)
    assert (saving_moments - plain_moments).norm() / plain_moments.norm() < 1e-2
