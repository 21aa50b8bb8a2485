"""LoRA (models/lora.py) end to end on a tiny random Qwen2: PEFT's layers against an explicit W0 + s B A model,
the learner training adapters only (1 and 2 FSDP2 ranks, float32 and bfloat16), versions of adapters merged by the
engine without drift, final/ as PEFT's adapter folder, checkpoints of adapters and their optimizer, the base model
as the KL reference, and the config's bounds."""

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from peft import PeftModel
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from nanoverl_async.cli import main
from nanoverl_async.config import ConfigError, KLConfig, LoRAConfig, load_config
from nanoverl_async.launcher import launch
from nanoverl_async.generators.builtin_engine import BuiltinEngine
from nanoverl_async.learners.batch import sequence_logprobs
from nanoverl_async.learners.fsdp_rank import LearnerRank
from nanoverl_async.models import lora
from nanoverl_async.observe.record import compare_weights
from test_fsdp import LEARNER, TEMPERATURE, free_port, make_batch, setup, write_model_dir

ADAPTERS = LoRAConfig(rank=4, alpha=8.0)
S = lora.scaling(ADAPTERS)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("tiny_qwen2"))


def lora_setup(model_dir, dtype="float32", world_size=1, adapters=ADAPTERS, **fields):
    learner = dataclasses.replace(LEARNER, lora=adapters)
    base = setup(model_dir, learner=learner, world_size=world_size, **fields)
    return dataclasses.replace(base, model=dataclasses.replace(base.model, dtype=dtype))


def random_adapters(model, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """PEFT-keyed factors for every layer LoRA adapts in `model` (a model with adapters), drawn from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return {lora.adapter_key(name): torch.randn(p.shape, generator=generator) * scale
            for name, p in model.named_parameters() if lora.adapter_key(name) is not None}


def injected(model_dir, seed=1):
    """The tiny model in float32 with adapters, B made non-zero (at the start B = 0 and the update is nil)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    lora.add_adapters(model, ADAPTERS)
    values = random_adapters(model, seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if lora.adapter_key(name) is not None:
                parameter.copy_(values[lora.adapter_key(name)])
    return model


def sequence_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return -sequence_logprobs(logits, ids, TEMPERATURE)[:, 1:].sum()


def test_lora_loss_and_gradients_equal_an_explicit_w0_plus_s_b_a_model(model_dir):
    model = injected(model_dir)
    ids = torch.randint(0, 100, (3, 12), generator=torch.Generator().manual_seed(2))
    loss = sequence_loss(model(input_ids=ids).logits, ids)
    loss.backward()
    peft_grads = {lora.adapter_key(n): p.grad for n, p in model.named_parameters() if p.requires_grad}
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    assert not frozen and len(peft_grads) == 2 * 7 * 2  # A and B of 7 linear layers in each of 2 decoder layers

    # the explicit model: the plain base, each adapted weight replaced by W0 + s B A of leaf tensors A, B
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    factors = {key: tensor.detach().clone().requires_grad_() for key, tensor in
               {lora.adapter_key(n): p for n, p in model.named_parameters() if p.requires_grad}.items()}
    base = dict(plain.named_parameters())
    weights = {name: base[name] + S * b @ a for name, (a, b) in lora.adapted_layers(factors).items()}
    explicit = sequence_loss(torch.func.functional_call(plain, weights, (ids,)).logits, ids)
    explicit.backward()
    assert loss.item() == pytest.approx(explicit.item(), rel=1e-6)
    for key, tensor in factors.items():
        torch.testing.assert_close(peft_grads[key], tensor.grad, rtol=1e-5, atol=1e-6)


def snapshot(learner) -> dict[str, torch.Tensor]:
    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
            for name, t in learner.model.state_dict().items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_learner_trains_the_adapters_only_and_publishes_them_alone(model_dir, dtype):
    learner = LearnerRank(lora_setup(model_dir, dtype), 0, "127.0.0.1", free_port())
    try:
        trained = {name: p for name, p in learner.model.named_parameters() if p.requires_grad}
        frozen = {name: p for name, p in learner.model.named_parameters() if not p.requires_grad}
        assert trained and all(lora.adapter_key(name) is not None for name in trained)
        assert {p.dtype for p in trained.values()} == {torch.float32}  # the master weights
        assert {p.dtype for p in frozen.values()} == {getattr(torch, dtype)}  # the base, at the run's dtype
        assert sum(len(group["params"]) for group in learner.optimizer.param_groups) == len(trained)
        # no compute copy held after start-up (every FSDP2 module resharded, not only the root)
        assert all(isinstance(p, DTensor) for p in learner.model.parameters()) == (dtype == "bfloat16")
        published = learner._published_state()
        assert set(published) == {lora.adapter_key(name) for name in trained}
        assert all(float(t.abs().sum()) == 0 for key, t in published.items() if ".lora_B." in key)  # v0 = base
        before = snapshot(learner)
        learner.update(make_batch(), 0)
        learner.update(make_batch(), 1)
        after = snapshot(learner)
    finally:
        learner.shutdown()
    for name in before:
        assert torch.equal(before[name], after[name]) == (lora.adapter_key(name) is None), name


def two_ranks(rank, ports, model_dir, out_dir):
    for world_size, port in ((2, ports[0]), (1, ports[1])):
        if rank >= world_size:
            continue
        learner = LearnerRank(lora_setup(model_dir, "float32", world_size), rank, "127.0.0.1", port)
        learner.update(make_batch(), 0)
        learner.update(make_batch(), 1)
        gathered = dict(learner._full_tensors(learner._published_state()))
        if rank == 0:
            torch.save(gathered, f"{out_dir}/published_{world_size}.pt")
        learner.shutdown()


def test_two_fsdp2_ranks_train_the_same_adapters_as_one(model_dir, tmp_path):
    mp.spawn(two_ranks, args=((free_port(), free_port()), model_dir, str(tmp_path)), nprocs=2, join=True)
    one, two = torch.load(tmp_path / "published_1.pt"), torch.load(tmp_path / "published_2.pt")
    assert one.keys() == two.keys()
    for key in one:  # two ranks shard the adapters and reduce their gradients (FSDP2), one trains them plainly
        torch.testing.assert_close(two[key], one[key], atol=1e-5, rtol=0)
    assert any(float(one[key].abs().sum()) > 0 for key in one if ".lora_B." in key)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merging_versions_never_drifts_and_zero_adapters_give_the_base_back_bit_for_bit(model_dir, dtype):
    engine = BuiltinEngine(model_dir, "cpu", dtype, num_blocks=8, lora_scaling=S)
    parameters = dict(engine.model.named_parameters())
    base = {name: p.detach().clone() for name, p in parameters.items()}
    shapes = injected(model_dir)
    versions = [random_adapters(shapes, seed) for seed in (1, 2, 3)]
    for version, adapters in enumerate(versions, start=1):
        engine.stage_weights(adapters, version)
        for name, (a, b) in lora.adapted_layers(adapters).items():
            assert torch.equal(parameters[name], lora.merged_weight(base[name], a, b, S)), name  # from W0, not v-1
    adapted = lora.adapted_layers(versions[0]).keys()
    assert all(torch.equal(parameters[name], base[name]) for name in parameters if name not in adapted)
    merged = {name: p.detach().clone() for name, p in parameters.items()}

    bad = dict(versions[0])
    key = next(iter(bad))
    bad[key] = bad[key][:, :-1]  # one factor of the wrong shape: refused, the model untouched
    with pytest.raises(KeyError, match="wrong shape"):
        engine.stage_weights(bad, 4)
    assert all(torch.equal(parameters[name], merged[name]) for name in parameters) and engine.version == 3

    zeros = {key: torch.zeros_like(tensor) for key, tensor in versions[0].items()}
    engine.stage_weights(zeros, 5)
    assert all(torch.equal(parameters[name], base[name]) for name in parameters)


def test_the_engine_with_merged_adapters_computes_what_the_learner_s_peft_layers_compute(model_dir):
    model = injected(model_dir)
    engine = BuiltinEngine(model_dir, "cpu", "float32", num_blocks=8, lora_scaling=S)
    engine.stage_weights(random_adapters(model, seed=1), 1)
    ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(engine.model(ids).logits, model(input_ids=ids).logits, atol=2e-5, rtol=1e-5)


def test_final_is_a_peft_adapter_folder_and_the_merged_model_beside_it(model_dir, tmp_path):
    adapters = dataclasses.replace(ADAPTERS, save_merged=True)
    learner = LearnerRank(lora_setup(model_dir, adapters=adapters), 0, "127.0.0.1", free_port())
    ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(4))
    try:
        learner.update(make_batch(), 0)
        learner.save_pretrained(str(tmp_path / "final"))
        with torch.no_grad():
            expected = learner.model(input_ids=ids).logits
    finally:
        learner.shutdown()
    with safe_open(tmp_path / "final" / lora.ADAPTER_FILE, "pt") as file:
        assert all(key.startswith(lora.PEFT_PREFIX) and ".lora_" in key for key in file.keys())
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "final")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final" / "merged", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_a_checkpoint_holds_the_adapters_and_their_optimizer_and_resumes_exactly(model_dir, tmp_path):
    first = LearnerRank(lora_setup(model_dir), 0, "127.0.0.1", free_port())
    try:
        first.update(make_batch(), 0)
        first.save_checkpoint(str(tmp_path / "learner"))
        first.update(make_batch(), 1)
        continued = snapshot(first)
    finally:
        first.shutdown()
    saved = torch.distributed.checkpoint.FileSystemReader(str(tmp_path / "learner")).read_metadata()
    model_keys = [key for key in saved.state_dict_metadata if key.startswith("policy.model.")]
    assert model_keys and all(".lora_" in key for key in model_keys)  # no base weight: the base is model.path
    assert any(key.startswith("policy.optimizer.state.") for key in saved.state_dict_metadata)
    resumed = LearnerRank(lora_setup(model_dir), 0, "127.0.0.1", free_port())
    try:
        resumed.load_checkpoint(str(tmp_path / "learner"))
        resumed.update(make_batch(), 1)
        assert all(torch.equal(t, continued[name]) for name, t in snapshot(resumed).items())
    finally:
        resumed.shutdown()


def test_the_kl_reference_of_a_lora_run_is_the_base_model_without_a_copy(model_dir):
    learner = LearnerRank(lora_setup(model_dir, kl=KLConfig(loss_coef=0.1)), 0, "127.0.0.1", free_port())
    batch = make_batch()
    try:
        assert learner.reference is None
        learner.update(make_batch(), 0)
        learner.update(make_batch(), 1)
        reference = learner.compute(batch, "reference_logprobs")
        proximal = learner.compute(batch, "proximal_logprobs")
    finally:
        learner.shutdown()
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        base = sequence_logprobs(plain(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits,
                                 batch.input_ids, TEMPERATURE)
    mask = batch.loss_mask.bool().numpy()
    np.testing.assert_allclose(reference[mask], base.numpy()[mask], atol=1e-5)
    assert np.abs(proximal[mask] - reference[mask]).max() > 1e-4  # the trained policy differs from its base


@pytest.mark.parametrize("override, wrong", [
    ("learner.lora.dropout=1.0", True), ("learner.lora.dropout=0.999", False),
    ("learner.lora.alpha=0", True), ("learner.lora.alpha=0.001", False),
    ("learner.lora.target_modules=[]", True), ("generator.engine=sglang", False),
    ("generator.sglang.weight_transport=nccl", True)])
def test_lora_config_bounds(override, wrong):
    overrides = ["learner.lora.rank=8", "generator.engine=sglang" if "sglang." in override else "run.seed=0", override]
    key = override.split("=")[0] if "lora" in override else "learner.lora.rank"
    if wrong:
        with pytest.raises(ConfigError, match=f"'{key}'"):
            load_config("configs/agent_grpo.yaml", overrides)
    else:
        assert load_config("configs/agent_grpo.yaml", overrides).learner.lora.rank == 8


@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj"], ["mlp.down_proj"]])
def test_the_adapter_count_of_the_fit_check_is_what_peft_adds(model_dir, targets):
    cfg = dataclasses.replace(ADAPTERS, target_modules=targets)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = sum(p.numel() for p in model.parameters())
    counted = lora.adapter_parameters(model, cfg)
    lora.add_adapters(model, cfg)
    assert counted == sum(p.numel() for p in model.parameters() if p.requires_grad) > 0
    assert sum(p.numel() for p in model.parameters() if not p.requires_grad) == before


def test_the_fit_check_counts_a_lora_base_at_its_dtype_s_bytes_and_no_reference_copy(model_dir):
    from nanoverl_async.controller import fit_check

    base = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    adapted = 4 * ((64 + 64) + (64 + 32) * 2 + (64 + 64) + (64 + 128) * 2 + (128 + 64)) * 2  # r (in + out), 2 layers
    lora_run = [f"model.path={model_dir}", "learner.lora.rank=4", "kl.loss_coef=0.1"]
    assert fit_check.learner_parameters(load_config(None, [*lora_run, "model.dtype=bfloat16"])) == (adapted, 2 * base)
    assert fit_check.learner_parameters(load_config(None, lora_run)) == (adapted, 4 * base)  # float32
    with_reference = load_config(None, [*lora_run, f"reference.path={model_dir}"])
    assert fit_check.learner_parameters(with_reference) == (adapted, 4 * base + 4 * base)



@pytest.mark.slow
def test_an_asynchronous_lora_run_samples_with_its_adapters_and_replays_to_its_final_adapters(ray_session, tmp_path,
                                                                                             capsys):
    """The default job with LoRA for 6 steps at staleness 1: the generators sample with each version's adapters
    merged (tokens sampled by the weights the learner holds match its logprobs: mismatch_kl ~ 0), final/ is
    PEFT's adapter folder, and `replay` of the recorded run gives the same adapters bit for bit."""
    run_dir = tmp_path / "lora"
    launch(load_config("configs/agent_grpo.yaml", [
        f"run.output_dir={run_dir}", "run.total_steps=6", "staleness.max=1", "learner.lora.rank=8",
        "learner.lr=1e-3", "run.record=true", "data.prompts_per_step=4", "data.samples_per_prompt=4",
        "run.progress=false"]))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["learner/version"] == 6 and max(row["staleness/max"] for row in rows) >= 1
    later = [row for row in rows[2:] if row["learner/same_version_fraction"] > 0]
    assert later and all(row["learner/mismatch_kl"] < 1e-4 for row in later)  # sampled by the merged adapters
    assert (run_dir / "final" / lora.ADAPTER_FILE).exists() and (run_dir / "final" / "adapter_config.json").exists()
    assert main(["replay", str(run_dir)]) == 0 and "bit for bit" in capsys.readouterr().out
    result = compare_weights(run_dir / "final", run_dir / "replay" / "final")
    assert result["identical"] == result["tensors"] == 2 * 7 * 4  # A and B of 7 linear layers x 4 (builtin:tiny)


def test_adapter_dropout_trains_in_the_update_alone_and_costs_the_proximal_forward(model_dir):
    dropping = lora_setup(model_dir, adapters=dataclasses.replace(ADAPTERS, dropout=0.5))
    assert lora_setup(model_dir).forwards == [] and dropping.forwards == ["proximal_logprobs"]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    lora.add_adapters(model, dataclasses.replace(ADAPTERS, dropout=0.5))
    model.eval()  # as the learner holds it
    with lora.adapter_dropout(model):
        training = {name: module for name, module in model.named_modules() if module.training}
    assert len(training) == 2 * 7 and all(name.endswith("lora_dropout.default") for name in training)
    assert all(isinstance(module, torch.nn.Dropout) and module.p == 0.5 for module in training.values())
    assert not any(module.training for module in model.modules())  # eval again after the update


def test_a_version_s_adapters_split_over_buckets_merge_once_whole(model_dir):
    engine = BuiltinEngine(model_dir, "cpu", "float32", num_blocks=8, lora_scaling=S)
    parameters = dict(engine.model.named_parameters())
    base = {name: p.detach().clone() for name, p in parameters.items()}
    adapters = random_adapters(injected(model_dir), seed=1)
    keys = list(adapters)
    first = {key: adapters[key].clone() for key in keys[:3]}  # layer 2's A here, its B in the next bucket
    engine.stage_weights(first, 1, bucket=(0, 2))
    assert engine.loading == 1 and all(torch.equal(parameters[n], base[n]) for n in parameters)  # nothing merged yet
    for key in first:
        first[key].zero_()  # the subscriber's buffer, reused for the next bucket: the engine kept its own copy
    engine.stage_weights({key: adapters[key] for key in keys[3:]}, 1, bucket=(1, 2))
    assert engine.version == 1 and engine.loading is None
    for name, (a, b) in lora.adapted_layers(adapters).items():
        assert torch.equal(parameters[name], lora.merged_weight(base[name], a, b, S)), name
