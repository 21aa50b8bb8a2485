"""The single controller: place the roles with Ray, then run the RL dataflow one step at a time.

    nanoverl-async launch configs/agent_grpo.yaml staleness.max=4

Generators stream trajectories into the buffer on their own; this loop only pulls staleness-bounded
batches, trains, and publishes weights (docs/design.md "Processes and data flow"). Every role is a plain
class (buffer/, generators/, learners/); Ray appears here to place them in processes, and in the actor
classes it runs them in (role_actors.py, learners/pool.py). A role that dies ends the run with `RunFailed`
naming it, never a hang: the loop waits on the buffer and on every generator at once, and every wait has
a timeout.

Steps count from 1, as everything a user reads does (the console, metrics.jsonl, checkpoints): step N updates
weights version N - 1 into version N and publishes it. Checkpoints (run.save_every, run.resume; layout in
checkpoint.py): after publishing version N the loop saves the whole async state as step_N (learner ranks
collectively, the buffer its own file, the controller meta.json last). A resumed run loads it into freshly placed
roles before any generator leases, publishes the restored weights first, and continues with step N + 1.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Optional

import ray

from nanoverl_async import checkpoint

from nanoverl_async.observe import record
from nanoverl_async.config import Config, ConfigError, RayConfig, load_config, to_dict, to_yaml
from nanoverl_async.agents.data import load_samples
from nanoverl_async.agents.user_code import UserCodeError
from nanoverl_async.learners.memory import GB
from nanoverl_async.learners.pool import LearnerPool
from nanoverl_async.observe.metrics import MetricsLogger, step_metrics
from nanoverl_async.models.load import check_positions, load_tokenizer, resolve_model_path, vocab_size
from nanoverl_async.runtime.fit_check import check_learner_fits
from nanoverl_async.runtime import warm_start
from nanoverl_async.runtime.preflight import prepare, tools_notice
from nanoverl_async.runtime.role_actors import BufferRole, GeneratorRole
from nanoverl_async.runtime.startup import phase, start_ray
from nanoverl_async.observe.trace import PipelineTrace, TracedRole
from nanoverl_async.wire.auth import run_keys


class RunFailed(RuntimeError):
    """A role died or a wait timed out; the message names the role."""


def launch(cfg: Config, started: Optional[float] = None) -> Path:
    """Run one training job; returns the output directory (metrics.jsonl, final/). `started`: the time.time()
    start-up counts from (the CLI's process start; default: now), up to the first trained step (time/startup_s)."""
    started = time.time() if started is None else started
    cfg = prepare(cfg)  # files, user code and run.resume checked; user paths made absolute
    checkpoint.inspect_output_dir(cfg)  # a folder this launch may not use is refused before the model is built
    phase(started, f"model {cfg.model.path}" + (" (built on first use, then cached)" if ":" in cfg.model.path else ""))
    try:  # a missing model, or a tokenizer that drops whitespace, fails here in one line, not in each role
        model_path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
        tokenizer = load_tokenizer(model_path)
    except (ValueError, OSError) as error:  # transformers raises OSError for a model it cannot find
        raise ConfigError(f"config key 'model.path': {str(error).strip().splitlines()[0]}") from None
    model_path = start_model(cfg, model_path)  # model.warm_start: RL starts from the warm-started model
    if measured := warm_start.report(model_path):
        phase(started, measured)
    if notice := tools_notice(cfg, tokenizer):
        phase(started, notice)
    check_positions(model_path, cfg.agent.max_total_tokens)  # the buffer drops longer trajectories
    predicted = predicted_memory(cfg, model_path, started)  # a builder's model too, before Ray and the roles
    output_dir = Path(cfg.run.output_dir)
    resume_from = checkpoint.open_output_dir(cfg)  # None: a fresh run (into an empty or cleared dir)
    checkpoint.claim(output_dir, "config.yaml").write_text(to_yaml(cfg))
    start = checkpoint.read_meta(resume_from)["step"] if resume_from else 0
    if resume_from:
        announce_resume(cfg, resume_from, started)
    if not ray.is_initialized():  # the CLI starts it while it imports this module (startup.py)
        phase(started, "starting Ray")
    started_ray = start_ray(cfg.ray)
    phase(started, f"placing the buffer, {cfg.generator.replicas} generator(s) and {cfg.learner.world_size} learner "
                   f"rank(s), each building its model")
    roles = Roles(cfg, model_path, resume_from, start)
    phase(started, "roles ready; generating the first batch")
    logger = MetricsLogger(output_dir, cfg.run.total_steps, cfg.run.progress,
                           wandb_config=to_dict(cfg) if cfg.run.wandb else None, start_step=start,
                           log_samples=cfg.run.log_samples, print_sample_every=cfg.run.print_sample_every)
    trace = PipelineTrace(output_dir, roles.traced(), start) if cfg.run.trace else None  # trace.json (trace.py)
    try:
        with checkpoint.writing("the run's files", output_dir):  # a full disk names itself
            train(cfg, roles, logger, start, trace, started)
        with checkpoint.writing("the final model", output_dir / checkpoint.FINAL), roles.failures("learner pool"):
            final = checkpoint.publish_final(output_dir, lambda folder: roles.learners.save_pretrained(str(folder)))
        # steps, reward first -> last, the learner's peak memory beside its prediction, where things are
        print(logger.summary(final, predicted), file=sys.stderr, flush=True)
    finally:
        if trace:
            trace.close()
        logger.close()
        roles.shutdown()
        if started_ray:
            ray.shutdown()
    return output_dir


def start_model(cfg: Config, model_path: str) -> str:
    """The model RL starts from: model.path resolved, after model.warm_start if it is on (made once, cached)."""
    try:
        return warm_start.warm_started(cfg, model_path)
    except (UserCodeError, ValueError) as error:  # the solver's or the environment's, in one line
        raise ConfigError(f"config key 'model.warm_start.solver': {error}") from None


def predicted_memory(cfg: Config, model_path: str, started: float) -> dict[str, float]:
    """The learner's fit check on the resolved model (whatever form model.path took: runtime/fit_check.py), in
    one ConfigError line if it cannot fit; else the prediction is logged once and returned as GB by the memory/*
    key it predicts (on a GPU the device peak, which leaves the runtime out), for the run's summary."""
    prediction = check_learner_fits(cfg, model_path)
    if prediction is None:
        return {}
    phase(started, f"learner memory: an update's peak predicted at {prediction.total / GB:.1f} GB a rank "
                   f"({prediction.parts()} GB; learners/memory.py)")
    if cfg.learner.device == "cuda":
        return {"memory/learner_peak_device_gb": (prediction.total - prediction.runtime) / GB}
    return {"memory/learner_peak_host_gb": prediction.total / GB}


def train(cfg: Config, roles: "Roles", logger: MetricsLogger, start: int = 0,
          trace: Optional[PipelineTrace] = None, started: Optional[float] = None) -> None:
    """The RL dataflow (docs/design.md "Processes and data flow"), generation running ahead in the background.
    With `started` (launch's start), the first step logs time/startup_s: seconds from then until it is trained."""
    samples_trained = start * cfg.data.prompts_per_step * cfg.data.samples_per_prompt  # every batch is B x G
    last_step_end = time.monotonic()
    for step in range(start + 1, cfg.run.total_steps + 1):  # step N: weights version N - 1 -> version N
        batch = roles.next_batch(version=step - 1)  # blocks until B complete groups at most eta versions older
        waited = time.monotonic() - last_step_end
        if started is not None and step == start + 1:
            phase(started, f"first batch ready; training step {step}")
        with roles.failures("learner pool"):
            train_batch = roles.learners.prepare(batch.trajectories)  # proximal logprobs (version step - 1), advantages
            prepared = time.monotonic()
            learner_metrics = roles.learners.update(train_batch)  # ppo_epochs x minibatches FSDP2 steps
            trained = time.monotonic()
            roles.publish_weights(version=step)  # async; generators apply it when ready
        samples_trained += len(batch.trajectories)
        now = time.monotonic()
        learner_metrics.update({"time/wait_batch_s": waited, "time/train_s": trained - last_step_end - waited,
                                "time/publish_s": now - trained})  # publish: the gather (+ nccl: the load)
        if started is not None and step == start + 1:
            learner_metrics["time/startup_s"] = time.time() - started
        if cfg.run.eval_every and step % cfg.run.eval_every == 0:
            learner_metrics.update(roles.evaluate(step))  # eval/*: data.val_files on generator 0's weights
        logger.log(step_metrics(step, cfg.staleness.max, batch, learner_metrics, now - last_step_end,
                                samples_trained), batch.trajectories)  # and run.log_samples episodes
        if trace:  # run.trace: this step's phases and episodes, and what the roles recorded meanwhile
            trace.step(step, batch.trajectories, (last_step_end, last_step_end + waited, prepared, trained, now))
        if cfg.run.record:  # the learner's input stream, for `nanoverl-async replay` (record.py)
            record.write_batch(cfg.run.output_dir, step, batch.trajectories)
        maybe_checkpoint(cfg, roles, step)  # step_N: the state after N steps, weights version N
        last_step_end = time.monotonic()  # a save's time is not the next step's


def maybe_checkpoint(cfg: Config, roles: "Roles", version: int) -> None:
    """Every run.save_every steps: learner ranks write their DCP shards, the buffer its state, then the
    controller meta.json and one rename make the folder complete (checkpoint.py)."""
    if not cfg.run.save_every or version % cfg.run.save_every:
        return
    folder = checkpoint.begin(cfg.run.output_dir, version)
    with checkpoint.writing(f"checkpoint step_{version}", folder):
        with roles.failures("learner pool"):
            roles.learners.save_checkpoint(str(folder / "learner"))
        # generators keep streaming: the buffer's state is a cut taken under its lock
        state, counters = roles.get("buffer", roles.buffer.state.remote(version), cfg.run.step_timeout_s)
        (folder / "buffer.msgpack").write_bytes(state)  # here, not on the buffer's node: no shared disk assumed
        written_on = {"learner": roles.learners.nodes, "buffer and meta": ray.util.get_node_ip_address()}
        checkpoint.commit(folder, checkpoint.make_meta(cfg, version, counters, written_on), cfg.run.keep_checkpoints)


def announce_resume(cfg: Config, resume_from: Path, started: float) -> None:
    """One line: the checkpoint resumed, and any other settings it resumes with (say a new learning rate:
    allowed, but never silent)."""
    meta = checkpoint.read_meta(resume_from)
    changed = checkpoint.changed_keys(meta["config"], checkpoint.trained_config(cfg))
    left = (f"steps {meta['step'] + 1}-{cfg.run.total_steps}" if meta["step"] < cfg.run.total_steps
            else "no step left, final/ to write")
    phase(started, f"resuming from {resume_from.name} ({resume_from}): {left}"
          + (f" with changed config keys: {', '.join(changed)}" if changed else ""))


def replay(run_dir: str) -> dict:
    """The learner alone on a run's recorded batches (record.py), in order, one prepare + update per step
    as in `train`; its weights go to RUN_DIR/replay/final and are compared with the run's final/."""
    cfg = load_config(str(Path(run_dir) / "config.yaml"))
    cfg = dataclasses.replace(cfg, wire=dataclasses.replace(cfg.wire, host="127.0.0.1"))  # no generator connects
    if not cfg.run.record:
        raise ConfigError(f"{run_dir}: run.record was off in this run's config.yaml, so there is nothing to replay")
    model_path = start_model(cfg, resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    batches = record.read_batches(run_dir, cfg.run.total_steps, vocab_size(model_path), cfg.agent.max_total_tokens)
    started_ray = start_ray(cfg.ray)
    learners = None
    try:
        with role_failures("learner pool"):
            learners = LearnerPool(cfg, model_path, run_keys())
            for trajectories in batches:
                learners.update(learners.prepare(trajectories))
            learners.save_pretrained(str(checkpoint.claim(run_dir, "replay") / "final"))
    finally:
        if learners is not None:
            learners.shutdown()
        if started_ray:
            ray.shutdown()
    return {"steps": len(batches), **record.compare_weights(Path(run_dir) / "final", Path(run_dir) / "replay" / "final")}


class Roles:
    """The placed processes: one buffer, `generator.replicas` generators, `learner.world_size` ranks,
    each built from `cfg` as preflight.prepare returned it (agent.env filled in, user paths absolute).
    With `resume_from` (a checkpoint of step `start`), buffer and learners restore it before any
    generator connects, and the restored weights are published before the constructor returns."""

    def __init__(self, cfg: Config, model_path: str, resume_from: Optional[Path] = None, start: int = 0):
        self.cfg, self.nodes = cfg, {}  # role -> node, known on a cluster once every role is up (_placement)
        check_placement(cfg.ray)
        # Every socket, loopback included, admits only processes holding this run's keys (kept in memory only)
        curve = self.curve = run_keys()
        # run.eval_every's prompts (validation checked that data.val_files is set), loaded once
        self.val_samples = [{**s, "index": i} for i, s in enumerate(load_samples(cfg.data.val_files,
                                                                                cfg.data.skip_rows))] \
            if cfg.run.eval_every else []
        # Every role's process starts at once (each spends seconds importing torch and loading a model), the
        # learner ranks first (the slowest: on a small machine they get Ray's prestarted workers), the buffer
        # last (it starts fast); generators connect to the buffer and the weights only once both exist.
        with role_failures("learner pool"):
            self.learners = LearnerPool(cfg, model_path, curve)
        generator_actor = ray.remote(num_cpus=0, num_gpus=generator_gpus(cfg),
                                     resources=cfg.ray.resources("generator"))(GeneratorRole)
        self.generators = [generator_actor.remote(generator_id=i, cfg=cfg, model_path=model_path)
                           for i in range(cfg.generator.replicas)]
        self.buffer = ray.remote(num_cpus=0, max_concurrency=4, resources=cfg.ray.resources("buffer"))(
            BufferRole).remote(cfg, vocab_size(model_path), curve=curve,
                               state=(resume_from / "buffer.msgpack").read_bytes() if resume_from else b"")
        with role_failures("learner pool"):
            self.learners.ready()
            if resume_from:
                self.learners.load_checkpoint(str(resume_from / "learner"), start)
        if cfg.learner.device == cfg.generator.device == "cuda" and cfg.generator.engine == "builtin":
            # on one GPU with learner rank 0: weights by CUDA IPC handles
            gpus = self.get("generators", [gen.gpu.remote() for gen in self.generators], cfg.run.step_timeout_s)
            with role_failures("learner pool"):
                self.learners.share_gpu_with(gpus)
        buffer_endpoints = self.get("buffer", self.buffer.bound_endpoints.remote(), 60)
        self.nodes = self._placement(buffer_endpoints) if cfg.ray.address else {}
        self.generator_runs = {gen.run.remote(buffer_endpoints, self.learners.weights_endpoint, curve):
                               f"generator {i}" for i, gen in enumerate(self.generators)}
        sglang = cfg.generator.sglang
        if cfg.generator.engine == "sglang" and sglang.weight_transport == "nccl":
            # Learner rank 0 loads every version into every server itself, so it joins one group with all
            # of them before the first publish. A generator's constructor returns once its servers are up.
            servers = [gen.sglang_endpoints.remote() for gen in self.generators]
            endpoints = self.get("generators (SGLang endpoints)", servers, sglang.launch_timeout_s + 60)
            with role_failures("learner pool"):
                self.learners.connect_sglang([e for per_generator in endpoints for e in per_generator], sglang)
        if resume_from:  # generators start on the base weights; the restored buffer leases only to `start`
            self.publish_weights(version=start)

    def _placement(self, buffer_endpoints: dict) -> dict[str, str]:
        """On a cluster: the node each role runs on (every failure names it), printed once with the
        endpoints the roles bound there."""
        # each generator answers once its constructor is done (an SGLang one's, once its servers are up)
        generator_nodes = self.get("generators", [gen.node.remote() for gen in self.generators],
                                   self.cfg.generator.sglang.launch_timeout_s + 60)
        nodes = {"learner pool": ", ".join(dict.fromkeys(self.learners.nodes)),
                 "buffer": self.get("buffer", self.buffer.node.remote(), 60),
                 **{f"generator {i}": node for i, node in enumerate(generator_nodes)}}
        print(f"placed: {'; '.join(f'{role} on {node}' for role, node in nodes.items())}. wire: buffer "
              f"{buffer_endpoints['leases']}, weights {self.learners.weights_endpoint} (CURVE)",
              file=sys.stderr)
        return nodes

    def failures(self, name: str):
        """role_failures naming the node `name` runs on too, on a cluster (which machine to look at)."""
        return role_failures(f"{name} on node {self.nodes[name]}" if name in self.nodes else name)

    def get(self, name: str, refs, timeout_s: float):
        """ray.get of what role `name` answers, within `timeout_s`; its death or a timeout: RunFailed naming it."""
        with self.failures(name):
            return ray.get(refs, timeout=timeout_s)

    def publish_weights(self, version: int) -> None:
        """The buffer learns of `version` first (it refuses tokens and requests from versions never
        published), then learner rank 0 publishes it."""
        self.get("buffer", self.buffer.publishing.remote(version), 60)
        with self.failures("learner pool"):
            self.learners.publish_weights(version)

    def evaluate(self, version: int) -> dict:
        """Near-greedy episodes on data.val_files by generator 0 once it holds weights `version` or newer
        (worker.evaluate) -> eval/* metrics."""
        return self.get("generator 0", self.generators[0].evaluate.remote(self.val_samples, version),
                        self.cfg.run.step_timeout_s)

    def next_batch(self, version: int):
        """The buffer's batch for the update of weights `version` (step version + 1), while watching every
        generator: a dead one fails the run, even when the batch is ready at the same moment (checked before
        the batch is returned)."""
        batch_ref = self.buffer.next_batch.remote(version, self.cfg.run.step_timeout_s)
        runs = list(self.generator_runs)
        while True:
            ready, _ = ray.wait([batch_ref, *runs], num_returns=1)
            ended, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
            for run_ref in ended:  # a generator's `run` only returns when it failed (or was stopped)
                name = self.generator_runs[run_ref]
                with self.failures(name):
                    ray.get(run_ref)
                raise RunFailed(f"{name} stopped unexpectedly during step {version + 1}")
            if batch_ref in ready:
                with self.failures("buffer"):
                    return ray.get(batch_ref)

    def traced(self) -> list[TracedRole]:
        """The buffer and each generator as run.trace reaches them: their `trace_events` (trace.py)."""
        named = [("buffer", self.buffer), *((f"generator {i}", gen) for i, gen in enumerate(self.generators))]
        return [TracedRole(name, partial(self._trace_events, name, actor)) for name, actor in named]

    def _trace_events(self, name: str, actor) -> tuple[float, list]:
        return self.get(name, actor.trace_events.remote(), 60)

    def shutdown(self) -> None:
        """Stop generators first (they talk to the others), then learners and buffer; never hangs."""
        for gen in self.generators:
            gen.stop.remote()
        ray.wait(list(self.generator_runs), num_returns=len(self.generator_runs), timeout=10)
        self.learners.shutdown()
        for actor in [*self.generators, self.buffer]:
            ray.kill(actor)


def generator_gpus(cfg: Config) -> float:
    """GPUs Ray reserves for one generator replica: an SGLang replica's servers run on the GPUs its actor
    is given (servers x tp_size); a builtin engine on cuda takes generator.gpus_per_replica."""
    if cfg.generator.device != "cuda":
        return 0
    sglang = cfg.generator.sglang
    return sglang.servers * sglang.tp_size if cfg.generator.engine == "sglang" else cfg.generator.gpus_per_replica


@contextmanager
def role_failures(name: str):
    """Turn a dead actor or a timed-out wait into RunFailed naming the role."""
    try:
        yield
    except (ray.exceptions.RayError, TimeoutError) as error:
        cause = getattr(error, "cause", None) or error
        raise RunFailed(f"{name}: {type(cause).__name__}: {str(cause).strip().splitlines()[-1]}") from error


def check_placement(cfg: RayConfig) -> None:
    """Every ray.*_resource must be offered by some node of the cluster: one line now, not actors pending
    until a timeout."""
    offered = ray.cluster_resources()
    for key in (f.name for f in dataclasses.fields(cfg) if f.name.endswith("_resource")):
        name = getattr(cfg, key)
        if name and name not in offered:
            custom = sorted(k for k in offered if k not in ("CPU", "GPU", "memory", "object_store_memory")
                            and not k.startswith(("node:", "accelerator_type:")))
            raise ConfigError(f"config key 'ray.{key}': no node of the Ray cluster offers the resource {name!r} "
                              f"(custom resources offered: {', '.join(custom) or 'none'}); start the node meant "
                              f"for it with ray start --resources='{{\"{name}\": 1}}'")
