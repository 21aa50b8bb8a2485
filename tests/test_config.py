"""Config loading: every bad input fails with one line naming the key, before anything starts."""

import subprocess
import sys

import pytest

from nanoverl_async.config import ConfigError, load_config

DEFAULT = "configs/agent_grpo.yaml"


def test_default_config_loads_with_overrides():
    cfg = load_config(DEFAULT, ["staleness.max=4", "learner.world_size=2", "generator.replicas=2"])
    assert cfg.staleness.max == 4 and cfg.learner.world_size == 2 and cfg.generator.replicas == 2
    assert cfg.model.path == "builtin:tiny"


@pytest.mark.parametrize("override, key", [
    ("staleness.max=-1", "staleness.max"),
    ("staleness.maxx=3", "staleness.maxx"),
    ("nosuchsection.x=1", "nosuchsection.x"),
    ("run.total_steps=abc", "run.total_steps"),
    ("learner.world_size=3", "learner.world_size"),
    ("generator.replicas=0", "generator.replicas"),
    ("weight_sync.mode=sometimes", "weight_sync.mode"),
    ("algorithm.correction=magic", "algorithm.correction"),
    ("learner.betas=[0.9]", "learner.betas"),
    ("learner.gpus_per_rank=2", "learner.gpus_per_rank"),  # a rank is one GPU or a share of one
    ("generator.gpus_per_replica=1.5", "generator.gpus_per_replica"),
    ("generator.gpus_per_replica=0", "generator.gpus_per_replica"),
])
def test_bad_override_names_the_key(override, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(DEFAULT, [override])


@pytest.mark.parametrize("overrides, key", [
    (["learner.minibatches=3"], "learner.minibatches"),  # 128 samples do not split in 3
    (["learner.world_size=2", "learner.minibatches=128"], "learner.minibatches"),
    (["learner.ppo_epochs=0"], "learner.ppo_epochs"),
    (["kl.reward_coef=0.1"], "kl.reward_coef"),  # grpo has no per-token reward to penalise
    (["reference.path=/some/model"], "reference.path"),  # KL is off: the reference would be unused
    (["algorithm.loss=gspo", "algorithm.correction=tis"], "algorithm.is_level"),
    (["algorithm.is_level=sequence"], "algorithm.is_level"),  # decoupled is token-level
    (["algorithm.correction=mis", "algorithm.is_low=6"], "algorithm.is_low"),
    (["algorithm.clip.ratio_c=0.5"], "algorithm.clip.ratio_c"),
    (["critic.lr=1e-5"], "critic"),  # only gae trains a critic
    (["algorithm.group_filter=true", "data.samples_per_prompt=1"], "algorithm.group_filter"),
    (["algorithm.overlong.buffer=96"], "algorithm.overlong.buffer"),
    (["algorithm.gamma=1.5"], "algorithm.gamma"),
    (["algorithm.loss=sft"], "algorithm.loss"),
])
def test_incompatible_algorithm_settings_fail_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(DEFAULT, overrides)


@pytest.mark.parametrize("name", ["agent_grpo", "drgrpo", "dapo", "gspo", "cispo", "ppo_critic", "smollm2_tools",
                                  "gpu/agent_grpo_sglang", "slow_tool", "long_tail", "code"])
def test_ready_configs_validate(name):
    load_config(f"configs/{name}.yaml")


def test_missing_and_malformed_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: {total_steps: 3\n  oops: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("run:\n  total_stepz: 3\n")
    with pytest.raises(ConfigError, match="run.total_stepz"):
        load_config(str(unknown))
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(str(scalar))


def test_override_without_equals_sign():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(DEFAULT, ["staleness.max"])


def test_cli_validate_prints_config_or_one_line_error():
    ok = subprocess.run([sys.executable, "-m", "nanoverl_async.cli", "validate", DEFAULT, "staleness.max=4"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "max: 4" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "nanoverl_async.cli", "validate", DEFAULT, "staleness.max=-2"],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "staleness.max" in bad.stderr
    assert "Traceback" not in bad.stderr
