"""Command line: `nanoverl-async launch|validate CONFIG [key=value ...]`.

    nanoverl-async launch configs/agent_grpo.yaml staleness.max=4 learner.world_size=2
    nanoverl-async validate configs/agent_grpo.yaml run.total_steps=10

A bad config (unknown key, wrong type, impossible value, missing or malformed YAML) prints one line
naming the key and exits with status 2 before anything starts; a run that fails exits with status 1.
"""

from __future__ import annotations

import argparse
import sys

from nanoverl_async.config import ConfigError, load_config, to_yaml
from nanoverl_async.preflight import prepare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nanoverl-async", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("launch", "run a training job"), ("validate", "print the resolved config")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("config", help="YAML config file, e.g. configs/agent_grpo.yaml")
        command.add_argument("overrides", nargs="*", help="dotted overrides, e.g. staleness.max=4")
    args = parser.parse_args(argv)

    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "validate":
            print(to_yaml(prepare(cfg)), end="")
            return 0
    except ConfigError as error:
        return config_error(error)

    from nanoverl_async.launcher import RunFailed, launch  # heavy imports (torch, ray) only when launching

    try:
        launch(cfg)  # checks files, user code and the output directory before anything starts
    except ConfigError as error:
        return config_error(error)
    except RunFailed as error:
        print(f"nanoverl-async: run failed: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("nanoverl-async: interrupted", file=sys.stderr)
        return 130
    return 0


def config_error(error: ConfigError) -> int:
    print(f"nanoverl-async: config error: {error}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
