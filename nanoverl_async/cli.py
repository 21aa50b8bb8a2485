"""Command line: `nanoverl-async launch|validate CONFIG [key=value ...]`, `plot|replay|simulate RUN_DIR ...`.

    nanoverl-async launch configs/agent_grpo.yaml staleness.max=4 learner.world_size=2
    nanoverl-async validate configs/agent_grpo.yaml run.total_steps=10
    nanoverl-async plot outputs/agent_grpo [more run directories] [-o out.png]
    nanoverl-async replay outputs/agent_grpo     # a run launched with run.record=true (record.py)
    nanoverl-async simulate outputs/agent_grpo --staleness 0,1,2,4,8 --generators 1,2,4   # run.trace=true

A bad config (unknown key, wrong type, impossible value, missing or malformed YAML) prints one line
naming the key and exits with status 2 before anything starts; a run that fails exits with status 1.
`plot` exits with status 2 and one line naming the file when a run directory lacks its metrics or config;
`replay` (controller/replay.py) exits with status 1 when the replayed weights differ from the run's. `simulate`
(simulator/simulate.py) exits with status 2 and one line when the run directory lacks a file or its trace has
no episodes, or a list is bad.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time

from nanoverl_async.config import ConfigError, load_config, to_yaml

# Start-up (time/startup_s) counts from here when this process is the command: the interpreter's own start
# before it, small (docs/benchmarks.md "Costs behind choices in the code"), is left out. Not /proc's start
# time of the process: a shell runs the last command of `... && nanoverl-async launch` in its own process
# (exec), whose start time is the shell's.
IMPORTED = time.time()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nanoverl-async", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("launch", "run a training job"), ("validate", "print the resolved config")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("config", help="YAML config file, e.g. configs/agent_grpo.yaml")
        command.add_argument("overrides", nargs="*", help="dotted overrides, e.g. staleness.max=4")
    plot = commands.add_parser("plot", help="draw runs' metrics into one PNG, runs labelled by config differences")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run.output_dir (metrics.jsonl, config.yaml)")
    plot.add_argument("-o", "--output", help="the PNG to write (default: <first RUN_DIR>/plot.png)")
    replay = commands.add_parser("replay", help="re-run the learner alone on a run's recorded batches (run.record)")
    replay.add_argument("run_dir", metavar="RUN_DIR", help="a run.output_dir of a run launched with run.record=true")
    simulate = commands.add_parser("simulate", help="predict samples/s, staleness and gated_frac for other staleness "
                                                    "limits and generator counts from a traced run (run.trace)")
    simulate.add_argument("run_dir", metavar="RUN_DIR", help="a run.output_dir of a run launched with run.trace=true")
    simulate.add_argument("--staleness", default="0,1,2,4,8", help="staleness.max values, comma-separated")
    simulate.add_argument("--generators", help="generator.replicas values, comma-separated (default: the run's)")
    simulate.add_argument("--cores", type=float, help="the run's machine's cores (default: this machine's)")
    simulate.add_argument("--seed", type=int, default=0, help="the simulation's seed")
    args = parser.parse_args(argv)
    if args.command in ("plot", "simulate"):
        return observe(args)
    if args.command == "replay":
        return replay_run(args.run_dir)

    # no torch: a config is checked in a fraction of a second
    from nanoverl_async.controller.preflight import inspect_output, prepare

    try:  # bad input fails in one line here, before Ray starts
        cfg = load_config(args.config, args.overrides)
        prepared = prepare(cfg)  # launch prepares `cfg` again (instant): prepared, wire.host is already placed
        if prepared.data.skip_rows:  # data.skip_long_prompts, or the user's own list
            print(f"nanoverl-async: {len(prepared.data.skip_rows)} dataset rows left out (data.skip_rows)",
                  file=sys.stderr)
        if args.command == "validate":
            print(to_yaml(prepared), end="")
            return 0
        inspect_output(prepared)  # a folder the launch may not use (holding a run, a user's files)
    except ConfigError as error:
        return config_error(error)

    import ray

    from nanoverl_async.reaper import Reaper
    from nanoverl_async.controller.startup import collecting_later, phase, start_ray_while_importing

    started = IMPORTED if argv is None else time.time()  # a call from Python (tests) counts from here
    watcher = Reaper()  # if this process is killed, it ends every process the run started (reaper.py)
    started_ray = False
    try:
        phase(started, "starting Ray, importing torch and transformers meanwhile")
        with collecting_later():  # heavy: only now
            started_ray, launcher = start_ray_while_importing(cfg.ray, "nanoverl_async.launcher")
        return launch_run(launcher, cfg, started, ["launch", args.config, *args.overrides])
    finally:
        if started_ray:
            ray.shutdown()
        watcher.release()


def launch_run(launcher, cfg, started: float, command: list[str]) -> int:
    """`launcher.launch`, its failures as one line and an exit status; `command` (the arguments it was
    launched with) is what an interrupted run is told to run again to resume."""
    from nanoverl_async.checkpoint import WriteFailed
    from nanoverl_async.controller.roles import RunFailed  # loaded with the launcher

    try:
        launcher.launch(cfg, started)
    except ConfigError as error:
        return config_error(error)
    except (RunFailed, WriteFailed) as error:
        print(f"nanoverl-async: run failed: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"nanoverl-async: interrupted; {resume_hint(cfg, command)}", file=sys.stderr)
        return 130
    return 0


def resume_hint(cfg, command: list[str]) -> str:
    """How to go on after an interrupted run: the same command with run.resume=auto when the run saved a
    checkpoint, else that it saved none."""
    from nanoverl_async.checkpoint import find_checkpoint

    found = find_checkpoint(dataclasses.replace(cfg.run, resume="auto")) if cfg.run.save_every > 0 else None
    if found is None:
        return "no checkpoint was saved, so it cannot be resumed (run.save_every=N saves one every N steps)"
    again = [arg for arg in command if not arg.startswith("run.resume=")] + ["run.resume=auto"]
    return f"to resume from checkpoint {found.name}: {shlex.join(['nanoverl-async', *again])}"


def observe(args: argparse.Namespace) -> int:
    """`plot` (prints the PNG's path) or `simulate` (its report); a bad run directory or flag is one line
    naming it, and status 2."""
    try:
        if args.command == "plot":
            from nanoverl_async.observe.plot import save_plot  # matplotlib only when plotting

            print(save_plot(args.run_dirs, args.output))
        else:
            from nanoverl_async.simulator.simulate import report

            print(report(args.run_dir, args.staleness, args.generators, args.cores, args.seed, progress=True))
    except ConfigError as error:
        print(f"nanoverl-async {args.command}: {error}", file=sys.stderr)
        return 2
    return 0


def replay_run(run_dir: str) -> int:
    """Exit 0 when the replayed weights equal the run's final/ bit for bit, 1 when they do not."""
    from nanoverl_async.controller.replay import replay
    from nanoverl_async.controller.roles import RunFailed

    try:
        result = replay(run_dir)
    except ConfigError as error:
        return config_error(error)
    except RunFailed as error:
        print(f"nanoverl-async: replay failed: {error}", file=sys.stderr)
        return 1
    same = result["identical"] == result["tensors"]
    print(f"replayed {result['steps']} steps: {result['identical']}/{result['tensors']} tensors equal the run's "
          f"final/ " + ("bit for bit" if same else f"(first mismatch {result['first_mismatch']}, largest "
                                                   f"difference {result['max_abs_diff']:.3g})"))
    return 0 if same else 1


def config_error(error: ConfigError) -> int:
    print(f"nanoverl-async: config error: {error}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
