"""Config loading: every bad input fails with one line naming the key, before anything starts."""

import json
import logging
import math
import pickle
import subprocess
import sys

import pytest

from nanoverl_async.config import ConfigError, load_config, to_yaml

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
    ("weight_sync.bucket_mb=0", "weight_sync.bucket_mb"),
    ("weight_sync.bucket_mb=0.5", "weight_sync.bucket_mb"),  # whole MiB
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
                                  "smollm2_shop", "gpu/agent_grpo_sglang", "slow_tool", "long_tail", "code"])
def test_ready_configs_validate(name):
    load_config(f"configs/{name}.yaml")


def test_the_builtin_engines_old_name_still_reads_with_one_warning_line(caplog):
    with caplog.at_level(logging.WARNING, logger="nanoverl_async.config"):
        cfg = load_config(None, ["generator.engine=transformers", "run.deterministic=true", "staleness.max=0"])
    assert cfg.generator.engine == "builtin" and "engine: builtin" in to_yaml(cfg)
    assert [record.getMessage() for record in caplog.records] == [
        "config key 'generator.engine': 'transformers' is deprecated, write 'builtin' (the same engine)"]
    assert load_config(None).generator.engine == "builtin"
    with pytest.raises(ConfigError, match="'generator.engine': 'vllm' is not one of builtin, sglang"):
        load_config(None, ["generator.engine=vllm"])


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


TYPO_CASES = [  # (a YAML file's text or None for DEFAULT, overrides, the line after "unknown config key ")
    (None, ["learner.lrr=1e-5"], "'learner.lrr'; did you mean 'learner.lr'?"),
    (None, ["lerner.lr=1e-5"], "'lerner.lr'; did you mean 'learner.lr'?"),  # the section corrected, the key kept
    (None, ["lerner.lrr=1e-5"], "'lerner.lrr'; did you mean 'learner.lr'?"),
    (None, ["generator.sglang.srvers=2"], "'generator.sglang.srvers'; did you mean 'generator.sglang.servers'?"),
    ("learner:\n  lrr: 1.0e-5\n", [], "'learner.lrr'; did you mean 'learner.lr'?"),
    ("lerner:\n  lr: 1.0e-5\n", [], "'lerner'; did you mean 'learner'?"),
    (None, ["learner.zzz=1"], "'learner.zzz'"),  # nothing close: no guess
    (None, ["no.such_key=1"], "'no.such_key'"),
    (None, ["learner.lr.x=1"], None),  # lr has no keys: its value is the problem, not a typo
]


@pytest.mark.parametrize("text, overrides, culprit", TYPO_CASES,
                         ids=[c[1][0] if c[1] else "yaml-" + c[0].split(":")[0] for c in TYPO_CASES])
def test_a_mistyped_key_is_one_line_with_the_nearest_key(tmp_path, capsys, text, overrides, culprit):
    from nanoverl_async.cli import main

    path = tmp_path / "typo.yaml"
    if text is not None:
        path.write_text(text)
    assert main(["validate", DEFAULT if text is None else str(path), *overrides]) == 2
    out, err = capsys.readouterr()
    if culprit is None:
        assert out == "" and err.startswith("nanoverl-async: config error: config key 'learner.lr': ") and \
            "did you mean" not in err and err.count("\n") == 1, err
    else:
        assert (out, err) == ("", f"nanoverl-async: config error: unknown config key {culprit}\n")


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


@pytest.mark.parametrize("override, most", [("run.total_steps", 2**31 - 1), ("generator.sglang.port_base", 65535),
                                            ("run.step_timeout_s", 2147483.647), ("run.seed", 2**32 - 1)])
def test_upper_bounds_are_inclusive(override, most):
    load_config(DEFAULT, [f"{override}={most}"])
    with pytest.raises(ConfigError, match=f"'{override}': must be at most {most}, got "):
        load_config(DEFAULT, [f"{override}={most + (1 if isinstance(most, int) else 0.001)}"])


@pytest.mark.parametrize("key", ["agent.hook_timeout_s", "agent.rollout_timeout_s"])
def test_hook_timeouts_are_positive_and_end_before_the_batch_wait(key):
    """0 is refused and the smallest positive float accepted; a bound at run.step_timeout_s is refused and the
    float just below it accepted (a hung hook is named only if its timeout comes before the buffer's)."""
    name = key.split(".")[1]
    with pytest.raises(ConfigError, match=f"^config key '{key}': must be > 0, got 0.0$"):
        load_config(DEFAULT, [f"{key}=0"])
    assert getattr(load_config(DEFAULT, [f"{key}=5e-324"]).agent, name) == 5e-324
    with pytest.raises(ConfigError, match=f"^config key '{key}': must be below run.step_timeout_s \\(300\\), or a hung "
                                          f"hook fails the step unnamed$"):
        load_config(DEFAULT, [f"{key}=300"])
    below = math.nextafter(300.0, 0.0)
    assert getattr(load_config(DEFAULT, [f"{key}={below!r}"]).agent, name) == below


def test_a_rollout_ends_before_its_groups_lease():
    with pytest.raises(ConfigError, match=r"^config key 'agent.rollout_timeout_s': must be below "
                                          r"buffer.lease_timeout_s \(300\): a group's lease must outlive its episodes"):
        load_config(DEFAULT, ["run.step_timeout_s=1000", "agent.rollout_timeout_s=300"])
    below = math.nextafter(300.0, 0.0)
    assert load_config(DEFAULT, ["run.step_timeout_s=1000", f"agent.rollout_timeout_s={below!r}"]).agent \
        .rollout_timeout_s == below


SECRET_OVERRIDES = ["generator.sglang.server_args=[--api-key, '${oc.env:NANOVERL_KEY}']",
                    "run.output_dir=/tmp/${oc.env:NANOVERL_KEY}", "model.path=${oc.env:NANOVERL_MODEL}"]


def test_a_value_from_the_environment_is_never_written(tmp_path, monkeypatch, capsys):
    """config.yaml (to_yaml), meta.json (make_meta), wandb's config and `validate` hold `${oc.env:NAME}`,
    never its value; the run itself uses the value, and config.yaml reloads to the same config."""
    from nanoverl_async import checkpoint
    from nanoverl_async.cli import main

    monkeypatch.setenv("NANOVERL_KEY", "hunter2")
    monkeypatch.setenv("NANOVERL_MODEL", "builtin:tiny")
    cfg = load_config(DEFAULT, SECRET_OVERRIDES)
    assert cfg.generator.sglang.server_args == ["--api-key", "hunter2"] and cfg.run.output_dir == "/tmp/hunter2"
    written = to_yaml(cfg)
    assert "hunter2" not in written and "  output_dir: /tmp/${oc.env:NANOVERL_KEY}\n" in written
    assert "    - --api-key\n    - ${oc.env:NANOVERL_KEY}\n" in written
    meta = json.dumps(checkpoint.make_meta(cfg, 3, {}))
    assert "hunter2" not in meta and '"server_args": ["--api-key", "${oc.env:NANOVERL_KEY}"]' in meta
    assert '"path": "builtin:tiny"' in meta  # a lineage key: its value, which a resume must match
    (tmp_path / "config.yaml").write_text(written)
    assert load_config(str(tmp_path / "config.yaml")) == cfg and to_yaml(pickle.loads(pickle.dumps(cfg))) == written
    assert main(["validate", DEFAULT, *SECRET_OVERRIDES]) == 0
    assert "hunter2" not in capsys.readouterr().out


def test_resume_with_the_same_environment_and_the_lineage_through_it(tmp_path, monkeypatch):
    from nanoverl_async import checkpoint
    from test_checkpoint import launch_config, opened, saved_run

    monkeypatch.setenv("NANOVERL_KEY", "hunter2")
    monkeypatch.setenv("NANOVERL_MODEL", "/models/a")
    saved_run(tmp_path, 4, *SECRET_OVERRIDES[::2])
    assert "hunter2" not in (tmp_path / "checkpoints" / "step_4" / "meta.json").read_text()
    resumed = launch_config(tmp_path, "run.resume=auto", *SECRET_OVERRIDES[::2])
    assert opened(resumed) == tmp_path / "checkpoints" / "step_4"
    meta = checkpoint.read_meta(tmp_path / "checkpoints" / "step_4")
    assert checkpoint.changed_keys(meta["config"], checkpoint.trained_config(resumed)) == []
    monkeypatch.setenv("NANOVERL_MODEL", "/models/b")  # another model under the same text: another run
    with pytest.raises(ConfigError, match=r"another run \(other model\.path\)"):
        opened(launch_config(tmp_path, "run.resume=auto", *SECRET_OVERRIDES[::2]))
