"""Learner memory (learners/memory.py, packing.chunked_head, learner.activation_checkpointing): the
checkpointed and chunked paths give the plain path's loss and gradients in float32 on 1 and 2 ranks (gloo),
a chunk's logits are not kept for backward, every update reports its memory/* peaks, and the start-up
check fails at the exact byte where the learner's persistent state no longer fits.

Run alone: `python -m pytest tests/test_learner_memory.py -q`.
"""

import dataclasses
from functools import partial

import pytest
import torch
import torch.multiprocessing as mp
from test_cli_run import read_metrics
from test_fsdp import ALGO, LEARNER, free_port, make_batch, model_dir, setup  # noqa: F401 (model_dir: a fixture)
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from nanoverl_async.config import ConfigError, ModelConfig, load_config
from nanoverl_async.learners.fsdp_rank import LearnerRank
from nanoverl_async.learners.memory import (GB, RUNTIME_BYTES, Architecture, Prediction, Workload, activation_bytes,
                                            compute_copy_bytes, layer_activation_bytes, learner_fit_error,
                                            logits_bytes, predict_peak)
from nanoverl_async.learners.packing import pack, prompt_lengths
from nanoverl_async.controller import fit_check
from nanoverl_async.controller.fit_check import check_learner_fits

ENTROPY_ALGO = dataclasses.replace(ALGO, entropy_coef=0.01)  # the entropy's gradient goes through the chunks too
SAVING = {"activation_checkpointing": True, "logits_chunk_tokens": 2}
PLAIN = {"activation_checkpointing": False, "logits_chunk_tokens": 0}


def first_step(rank, world_size, port, model_dir, learner_fields):
    """One update of the batch on `world_size` ranks (micro-batches of one sequence): its metrics and the
    clipped gradient (AdamW's first moment / (1 - beta1) after one step) by parameter name."""
    cfg = dataclasses.replace(LEARNER, micro_batch_tokens=1, **learner_fields)
    learner = LearnerRank(setup(model_dir, ENTROPY_ALGO, cfg, world_size), rank, "127.0.0.1", port)
    try:
        metrics = learner.update(make_batch(), 0)
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


def a_workload(**fields) -> Workload:
    """0.5B-like numbers: 100M trained parameters, 2 layers of hidden 64, a 1,000-wide head, 512 tokens."""
    return Workload(**{"trained": 100_000_000, "frozen_bytes": 0, "arch": Architecture(64, 160, 2, 4, 2, 16, 1_000),
                       "parameters": 100_000_000, "root_parameters": 40_000_000, "compute_bytes": 2, "tokens": 512,
                       "row": 256, "trained_tokens": 512, **fields})


def test_each_part_of_the_prediction_follows_its_formula():
    arch = Architecture(hidden=64, intermediate=160, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=1_000)
    # tokens x (8h + b (4h + 4q + 4i + row) + 4 heads + 8), q = 64, rows of 5: 512 + 2 x (256 + 256 + 640 + 5) + 24
    assert layer_activation_bytes(arch, 10, 2, 5) == 10 * 2_850
    assert activation_bytes(arch, 10, 2, False, 5) == 2 * 10 * 2_850 + 10 * (4 + 4) * 64
    assert activation_bytes(arch, 10, 2, True, 5) == 2 * 10 * 2 * 64 + 10 * 2_850 + 10 * 8 * 64
    assert logits_bytes(1_000, 300, 0) == 5 * 4 * 1_000 * 300 and logits_bytes(1_000, 300, 128) == 5 * 4 * 1_000 * 128
    assert logits_bytes(1_000, 100, 128) == 5 * 4 * 1_000 * 100  # no more trained tokens than a chunk: one pass
    # one rank keeps the whole model's compute copy; one float32 rank has none; several, the root and 2 layers
    assert compute_copy_bytes(1_000, 400, 3, 1, 2) == 2_000 and compute_copy_bytes(1_000, 400, 3, 1, 4) == 0
    assert compute_copy_bytes(1_000, 400, 3, 1, 2, trained=10) == 2_020  # one rank: its gradients in bfloat16 too
    assert compute_copy_bytes(1_000, 400, 3, 1, 4, trained=10) == 0  # one float32 rank: the plain model
    assert compute_copy_bytes(1_000, 400, 3, 2, 2) == 2 * (400 + 2 * 200) == compute_copy_bytes(1_000, 400, 3, 2, 2, 10)
    work = a_workload()
    prediction = predict_peak(work, 2)
    assert prediction == Prediction(8 * 100_000_000, 2 * (40_000_000 + 2 * 30_000_000),
                                    activation_bytes(work.arch, 512, 2, False, 256), logits_bytes(1_000, 512, 0),
                                    RUNTIME_BYTES["cpu"])
    assert prediction.total == sum(dataclasses.astuple(prediction))


def test_the_fit_check_refuses_one_byte_past_the_prediction():
    work = a_workload()
    predict = partial(predict_peak, work)
    total = predict(1).total
    assert learner_fit_error(predict, 1, total, "GPU memory") is None
    refused = learner_fit_error(predict, 1, total - 1, "GPU memory (H100)", remedies=("learner.lora.rank=16",))
    assert refused.startswith(f"the learner cannot fit: an update's peak is predicted at {total / GB:.1f} GB a rank")
    assert "\n" not in refused and f"> {(total - 1) / GB:.1f} GB of GPU memory (H100)" in refused
    assert "state + " in refused and "runtime GB)" in refused  # its parts
    fewest = next(ranks for ranks in range(2, 100) if predict(ranks).total <= total - 1)
    assert fewest == 2 and refused.endswith("use learner.lora.rank=16, learner.world_size >= 2 (one GPU each)")
    # CPU ranks on one host: every rank's peak lands in the same memory, so more ranks do not help
    assert learner_fit_error(predict, 2, 2 * predict(2).total, "host memory", ranks_share_it=True) is None
    shared = learner_fit_error(predict, 2, 2 * predict(2).total - 1, "host memory", ranks_share_it=True)
    assert "x 2 ranks on one host" in shared and "world_size" not in shared and shared.endswith("a smaller model")


def test_launch_refuses_a_learner_that_cannot_fit_before_any_role_starts(model_dir, monkeypatch):
    cfg = load_config(None, [f"model.path={model_dir}", "learner.world_size=2", "learner.micro_batch_tokens=192"])
    trained = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    # counted from the config alone: the policy; with KL the reference, frozen; with gae the critic, trained
    assert fit_check.learner_parameters(cfg) == (trained, 0)
    assert fit_check.learner_parameters(load_config(None, [f"model.path={model_dir}", "kl.loss_coef=0.1"])) == \
        (trained, 4 * trained)
    critic = trained + 64 + 1  # the same body (its tied head was the embedding) and a score head [1, 64] + bias
    assert fit_check.learner_parameters(load_config(None, [f"model.path={model_dir}", "algorithm.advantage=gae"])) \
        == (trained + critic, 0)
    assert fit_check.learner_parameters(load_config(None, ["model.path=builtin:tiny"])) is None  # not built here
    work = fit_check.learner_workload(cfg)
    assert (work.tokens, work.arch.layers, work.arch.vocab, work.parameters) == (192, 2, 100, trained)
    # the whole batch per rank at micro_batch_tokens 0: 16 x 8 sequences / 2 ranks x 96 tokens
    assert fit_check.micro_batch_tokens(load_config(None, ["learner.world_size=2"])) == 64 * 96
    total = fit_check.learner_prediction(cfg).total
    monkeypatch.setattr(fit_check, "learner_memory", lambda cfg: (2 * total, "host memory"))
    assert check_learner_fits(cfg).total == total  # 2 CPU ranks on one host: exactly fits
    monkeypatch.setattr(fit_check, "learner_memory", lambda cfg: (2 * total - 1, "host memory"))
    with pytest.raises(ConfigError, match="config key 'model.path': the learner cannot fit.*host memory.*"
                                          "learner.activation_checkpointing=true"):
        check_learner_fits(cfg)


def saved_bytes(path: str, checkpointing: bool) -> tuple[int, int]:
    """(bytes of the distinct tensors one training forward of a bfloat16 FSDP2 rank saves for backward, not
    its weights; the [rows, row] it ran)."""
    cfg = dataclasses.replace(LEARNER, activation_checkpointing=checkpointing)
    learner = LearnerRank(dataclasses.replace(setup(path, learner=cfg), model=ModelConfig(path, "bfloat16")),
                          0, "127.0.0.1", free_port())
    try:
        batch = make_batch()
        packing = pack(batch.input_ids, batch.attention_mask, prompts=prompt_lengths(batch.loss_mask),
                       wanted=batch.loss_mask)
        weights = {shape for param in learner.model.parameters() for shape in (param.shape, param.shape[::-1])}
        storages = {}

        def keep(tensor):
            if tensor.shape not in weights:
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            packing.logprobs(learner.model, 0.8)
        return sum(storages.values()), packing.input_ids.shape
    finally:
        learner.shutdown()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_decoder_layer_saves_exactly_what_the_activation_formula_counts(tmp_path, checkpointing):
    """One more layer (3 against 2) adds layer_activation_bytes to what a forward saves, or with checkpointing
    its input alone (2h bytes a token): the formula's terms are those tensors, byte for byte."""
    arch = Architecture(hidden=64, intermediate=160, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=100)
    saved = {}
    for layers in (2, 3):
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
                         ).save_pretrained(tmp_path / str(layers))
        saved[layers], (rows, row) = saved_bytes(str(tmp_path / str(layers)), checkpointing)
    assert rows * row > 2 * row  # several rows, prompts shared: the attention mask in every layer's count
    one_layer = rows * row * 2 * 64 if checkpointing else layer_activation_bytes(arch, rows * row, 2, row)
    assert saved[3] - saved[2] == one_layer


BIG_BUILDER = """
from pathlib import Path
from transformers import Qwen2Config
from nanoverl_async.models.tiny import build_tokenizer

def qwen7b_shape(cache_dir):  # Qwen2.5-7B's config beside a tokenizer, no weights: counting needs none
    directory = Path(__file__).parent / "qwen7b"
    Qwen2Config(vocab_size=152_064, hidden_size=3_584, intermediate_size=18_944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=4_096).save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return str(directory)
"""


def test_launch_refuses_a_builders_model_too_big_before_ray_starts(tmp_path, monkeypatch):
    """model.path=file.py:fn: the fit check runs on the directory the builder returns, before Ray or any role."""
    from nanoverl_async import launcher

    (tmp_path / "big.py").write_text(BIG_BUILDER)
    monkeypatch.setattr(launcher, "start_ray", lambda cfg: pytest.fail("Ray started"))
    cfg = load_config(None, [f"model.path={tmp_path / 'big.py'}:qwen7b_shape", f"run.output_dir={tmp_path / 'out'}"])
    with pytest.raises(ConfigError) as refused:
        launcher.launch(cfg)
    line = str(refused.value)
    assert line.startswith("config key 'model.path': the learner cannot fit: an update's peak is predicted at")
    assert "\n" not in line and "this machine's memory" in line


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
            metrics = learner.update(make_batch(), 0)
            state = learner.optimizer.state
            steps[name] = metrics, torch.cat([state[p]["exp_avg"].full_tensor().flatten()
                                              for p in learner.model.parameters()])
        finally:
            learner.shutdown()
    (plain, plain_moments), (saving, saving_moments) = steps["plain"], steps["saving"]
    assert saving["loss"] == pytest.approx(plain["loss"], rel=1e-2, abs=1e-4)
    assert (saving_moments - plain_moments).norm() / plain_moments.norm() < 1e-2
