"""The single controller: place the roles, then run the RL dataflow one step at a time.

    nanoverl-async launch configs/agent_grpo.yaml staleness.max=4

Generators stream trajectories into the buffer on their own; this loop only pulls staleness-bounded
batches, trains, and publishes weights (docs/design.md "Processes and data flow"). Every role is a plain
class (buffer/, generators/, learners/); controller/roles.py places them in processes with Ray and holds
every wait on them: a role that dies ends the run with `RunFailed` naming it, never a hang.

Steps count from 1, as everything a user reads does (the console, metrics.jsonl, checkpoints): step N updates
weights version N - 1 into version N and publishes it. Checkpoints (run.save_every, run.resume; layout in
checkpoint.py): after publishing version N the loop saves the whole async state as step_N (learner ranks
collectively, the buffer its own file, the controller meta.json last). A resumed run loads it into freshly placed
roles before any generator leases, publishes the restored weights first, and continues with step N + 1.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import ray

from nanoverl_async import checkpoint

from nanoverl_async.observe import record
from nanoverl_async.config import Config, to_dict, to_yaml
from nanoverl_async.observe.metrics import MetricsLogger, step_metrics
from nanoverl_async.controller.preflight import launch_plan, resume_line
from nanoverl_async.controller.roles import Roles
from nanoverl_async.controller.startup import phase, start_ray
from nanoverl_async.observe.trace import PipelineTrace


def launch(cfg: Config, started: Optional[float] = None) -> Path:
    """Run one training job; returns the output directory (metrics.jsonl, final/). `started`: the time.time()
    start-up counts from (the CLI's process start; default: now), up to the first trained step (time/startup_s)."""
    started = time.time() if started is None else started
    plan = launch_plan(cfg, started)  # the config, the model and the checkpoint resumed, each resolved once
    cfg = plan.cfg
    output_dir = Path(cfg.run.output_dir)
    checkpoint.open_output_dir(cfg, plan.output)  # as the plan found it: a fresh run's cleared, a new one marked
    checkpoint.claim(output_dir, "config.yaml").write_text(to_yaml(cfg))
    if plan.resume_from:
        phase(started, resume_line(cfg, plan.output))
    if not ray.is_initialized():  # the CLI starts it while it imports this module (startup.py)
        phase(started, "starting Ray")
    started_ray = start_ray(cfg.ray)
    phase(started, f"placing the buffer, {cfg.generator.replicas} generator(s) and {cfg.learner.world_size} learner "
                   f"rank(s), each building its model")
    roles = Roles(cfg, plan.model_path, plan.resume_from, plan.start)
    phase(started, "roles ready; generating the first batch")
    logger = MetricsLogger(output_dir, cfg.run.total_steps, cfg.run.progress,
                           wandb_config=to_dict(cfg) if cfg.run.wandb else None, start_step=plan.start,
                           log_samples=cfg.run.log_samples, print_sample_every=cfg.run.print_sample_every)
    trace = PipelineTrace(output_dir, roles.traced(), plan.start) if cfg.run.trace else None  # trace.json (trace.py)
    try:
        with checkpoint.writing("the run's files", output_dir):  # a full disk names itself
            train(cfg, roles, logger, plan.start, trace, started)
        with checkpoint.writing("the final model", output_dir / checkpoint.FINAL), roles.failures("learner pool"):
            final = checkpoint.publish_final(output_dir, lambda folder: roles.learners.save_pretrained(str(folder)))
        # steps, reward first -> last, the learner's peak memory beside its prediction, where things are
        print(logger.summary(final, plan.predicted), file=sys.stderr, flush=True)
    finally:
        if trace:
            trace.close()
        logger.close()
        roles.shutdown()
        if started_ray:
            ray.shutdown()
    return output_dir


def train(cfg: Config, roles: Roles, logger: MetricsLogger, start: int = 0,
          trace: Optional[PipelineTrace] = None, started: Optional[float] = None) -> None:
    """The RL dataflow (docs/design.md "Processes and data flow"), generation running ahead in the background.
    With `started` (launch's start), the first step logs time/startup_s: seconds from then until it is trained."""
    samples_trained = start * cfg.data.episodes_per_step
    last_step_end = time.monotonic()
    for step in range(start + 1, cfg.run.total_steps + 1):  # step N: weights version N - 1 -> version N
        batch = roles.next_batch(version=step - 1)  # blocks until B complete groups at most eta versions older
        waited = time.monotonic() - last_step_end
        if started is not None and step == start + 1:
            phase(started, f"first batch ready; training step {step}")
        with roles.failures("learner pool"):
            train_batch = roles.learners.prepare(batch.trajectories)  # proximal logprobs (version step - 1), advantages
            prepared = time.monotonic()
            learner_metrics = roles.learners.update(train_batch, version=step - 1)  # epochs x minibatches FSDP2 steps
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


def maybe_checkpoint(cfg: Config, roles: Roles, version: int) -> None:
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
