"""A config's YAML, read strictly: a file of sections, or one override's value.

    cfg_tree = read_yaml("configs/agent_grpo.yaml")        # a DictConfig; config.load_config merges it
    value = yaml.load("[1, 2]", ConfigLoader)              # an override's value (config.load_config)

yaml's SafeLoader builds no objects, but it still expands aliases, keeps the later of two equal keys and
recurses as deep as the text nests: ConfigLoader refuses each, at its line and column, so a mistake or a crafted
file is one ConfigError line naming the file (or the key), never a hang, a stack overflow or a silent override.
An error merging it into the config tree is one line too (`describe`), a mistyped key with the nearest real one.
A value written as an interpolation (`${oc.env:WANDB_API_KEY}`) is used resolved and written back as its text
(`Interpolated`, `keep_interpolated`): an environment variable's value never reaches a run's files.

Run alone: `python -m pytest tests/test_bad_input.py -q -k yaml`.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nanoverl_async.validation import ConfigError


def read_yaml(path: str) -> Any:
    """A YAML file of config sections -> DictConfig; a missing file, bad YAML (with line and column) or
    a non-mapping is one ConfigError line naming the file."""
    file = Path(path)
    if not file.is_file():
        missing = "is a folder, not a YAML file" if file.is_dir() else "does not exist"
        raise ConfigError(f"config file '{path}' {missing}")
    try:
        loaded = yaml.load(file.read_text(encoding="utf-8"), ConfigLoader)
    except (UnicodeDecodeError, OSError) as error:  # a binary file, a Latin-1 one, an unreadable one
        what = f"is not UTF-8 text (byte {error.object[error.start]:#04x} at offset {error.start})" \
            if isinstance(error, UnicodeDecodeError) else f"cannot be read ({error.strerror})"
        raise ConfigError(f"config file '{path}' {what}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"config file '{path}' {yaml_problem(error)}") from None
    if loaded is None:  # empty or only comments: most likely the wrong file, so not silently the defaults
        raise ConfigError(f"config file '{path}' is empty; write at least one section (e.g. run:), or {{}} "
                          f"for the defaults")
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of sections, not a {type(loaded).__name__}")
    return OmegaConf.create(loaded)


MAX_DEPTH = 16  # nesting levels of a config's YAML (sections, lists in them): far more than any key needs
MAX_DIGITS = 100  # an integer's digits: beyond any value validation accepts, far below Python's parsing limit


class ConfigLoader(yaml.SafeLoader):
    """yaml's SafeLoader without what only a mistake or an attack writes in a config, each refused at its
    line: aliases (`*name`: a few lines of them expand into billions of nodes, or into themselves; repeat a
    value with `${section.key}`), a key twice in one mapping (the later would silently win), nesting deeper
    than MAX_DEPTH (deeper would overflow Python's stack) and integers of more than MAX_DIGITS digits."""

    def __init__(self, stream):
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.fail("aliases (*name) are not supported; repeat a value with an interpolation, ${section.key}")
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                self.fail(f"nests deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key in (key for key, _ in node.value if isinstance(key, yaml.ScalarNode)):
            if key.value in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key '{key.value}' (a key may "
                                                        f"appear once in a mapping)", key.start_mark)
            seen.add(key.value)
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node):
        digits = sum(c.isdigit() for c in node.value)
        if digits > MAX_DIGITS:
            raise yaml.constructor.ConstructorError(None, None, f"an integer of {digits} digits is beyond any "
                                                    f"config value", node.start_mark)
        return super().construct_yaml_int(node)

    def fail(self, problem: str):
        raise yaml.composer.ComposerError(None, None, problem, self.peek_event().start_mark)


ConfigLoader.add_constructor("tag:yaml.org,2002:int", ConfigLoader.construct_yaml_int)


def yaml_problem(error: yaml.YAMLError) -> str:
    """'is not valid YAML at line L, column C: the problem', from the parser's or ConfigLoader's error."""
    where = getattr(error, "problem_mark", None)
    at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
    return f"is not valid YAML{at}: {getattr(error, 'problem', error)}"


def describe(error: OmegaConfBaseException, root: Any, override_key: str = "") -> str:
    """An OmegaConf error merging into the config tree `root` (config.Config()) -> one line naming the key; an
    unknown key with the nearest real one."""
    key = getattr(error, "full_key", None) or override_key or "?"
    message = str(error).strip().splitlines()[0]
    if "not in struct" in message or "Key '" in message and "not" in message:
        unknown = override_key or key
        near = nearest_key(unknown, root)
        return f"unknown config key '{unknown}'" + (f"; did you mean '{near}'?" if near else "")
    return f"config key '{key}': {message}"


def nearest_key(dotted: str, root: Any) -> Optional[str]:
    """The key of the dataclass tree `root` a mistyped `dotted` most likely meant: each part that is no field of
    its section replaced by the closest that is (`lerner.lrr` -> `learner.lr`); None when some part has none."""
    node, parts = root, []
    for part in dotted.split("."):
        names = [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []
        close = [part] if part in names else difflib.get_close_matches(part, names, n=1)
        if not close:
            return None
        parts.append(close[0])
        node = getattr(node, close[0])
    return ".".join(parts)


class Interpolated(str):
    """A string value set through an interpolation: the run uses the value; `text` is what was written
    (e.g. `${oc.env:WANDB_API_KEY}`), and all that the files a run writes hold (`to_dict`)."""

    def __new__(cls, value: str, text: str):
        string = super().__new__(cls, value)
        string.text = text
        return string

    def __reduce__(self):  # copies and pickles (Ray) keep the text
        return Interpolated, (str(self), self.text)


def keep_interpolated(node: Any, written: dict) -> None:
    """Every string of `node` (a list's too) whose `written` text has an interpolation becomes Interpolated."""
    def kept(value: Any, text: Any) -> Any:
        return Interpolated(value, text) if isinstance(value, str) and isinstance(text, str) and "${" in text \
            else value
    for key in dataclasses.fields(node):
        value, text = getattr(node, key.name), written[key.name]
        if dataclasses.is_dataclass(value):
            keep_interpolated(value, text)
        elif isinstance(value, list) and isinstance(text, list):
            setattr(node, key.name, [kept(v, t) for v, t in zip(value, text)])
        else:
            setattr(node, key.name, kept(value, text))
