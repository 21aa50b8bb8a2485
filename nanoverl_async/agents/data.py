"""verl-format datasets: parquet or jsonl rows -> samples for the buffer's prompt frontier.

A row, as verl writes it (e.g. volcengine/verl/examples/data_preprocess/gsm8k.py):

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],            # a list of chat messages
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0}}              # anything JSON-able

    prompts = DatasetPrompts(["train.parquet"], seed=0)        # data.train_files, run.seed
    sample = prompts(index)   # {"index", "messages", "data_source", "reward_model", "extra_info", ...}

Invariants: `DatasetPrompts` is a pure function of (files, skip, seed, index): epoch e = index // len(rows)
visits every row once in an order shuffled by (seed, e), so a resumed run re-issues the same prompts;
a sample is JSON-able (it travels to generators as msgpack; pyarrow's to_pylist gives plain Python values).
Rows are loaded lazily on the first call, in the process that uses them (the buffer), so only the
file names cross process boundaries. A row without a list-of-messages `prompt` fails loudly, naming
the file, the row and the column (preflight.py reads every file once when the run starts, and measures
each prompt against agent.max_total_tokens). The rows data.skip_rows names are left out.

Run alone: `python -m pytest tests/test_env_data.py -q`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import random
from pathlib import Path
from typing import Callable, Collection

from nanoverl_async.config import DataConfig
from nanoverl_async.agents.user_code import load_object, user_error


def read_rows(path: str) -> list[dict]:
    """All rows of one .parquet (pyarrow) or .jsonl file, as plain Python values (never numpy)."""
    if not path.endswith((".parquet", ".jsonl", ".json")):
        raise ValueError(f"'{path}' is not a .parquet or .jsonl file")
    if not Path(path).is_file():
        raise ValueError(f"file '{path}' does not exist")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as error:  # noqa: BLE001 - pyarrow raises several types for a bad file
            raise ValueError(f"{path}: not a readable parquet file ({type(error).__name__}: {error})") from None
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines()):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} line {number + 1}: not JSON ({error.msg})") from None
    return rows


def to_sample(row: dict, where: str) -> dict:
    """A verl row -> a sample: `messages` is the prompt; every other field kept as is (JSON-able)."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    if row.get("prompt") is None:  # absent, or null (a parquet file has every column in every row)
        columns = ", ".join(repr(k) for k, v in row.items() if v is not None) or "none"
        raise ValueError(f"{where}: no 'prompt' column (the row has {columns})")
    prompt = row["prompt"]
    if isinstance(prompt, str) and prompt.lstrip().startswith("["):  # a JSON-encoded message list (some exports)
        with contextlib.suppress(json.JSONDecodeError):  # reported below as what it is: not a message list
            prompt = json.loads(prompt)
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m for m in prompt):
        raise ValueError(f"{where}: column 'prompt' must be a list of {{'role', 'content'}} messages, "
                         f"got {prompt!r:.80}")
    # a parquet file has every struct field in every message: absent ones come back as None
    return {**{k: v for k, v in row.items() if k != "prompt"},
            "messages": [{k: v for k, v in m.items() if v is not None} for m in prompt]}


def read_samples(files: list[str]) -> list[tuple[str, int, dict]]:
    """(file, row number, sample) of every row of `files`, in order; there must be one at least."""
    samples = [(path, i, to_sample(row, f"{path} row {i}")) for path in files for i, row in enumerate(read_rows(path))]
    if not samples:
        raise ValueError(f"no rows in {files}")
    return samples


def load_samples(files: list[str], skip: Collection[str] = ()) -> list[dict]:
    """Every row's sample but those `skip` names ('<file> row <i>': data.skip_rows)."""
    samples = [sample for path, i, sample in read_samples(files) if f"{path} row {i}" not in skip]
    if not samples:
        raise ValueError(f"every row of {files} is in data.skip_rows")
    return samples


@functools.lru_cache(maxsize=4)  # the frontier moves forward; re-issued prompts may come from the epoch before
def epoch_order(rows: int, seed: int, epoch: int) -> list[int]:
    """The order in which epoch `epoch` visits `rows` rows: a shuffle seeded by (seed, epoch)."""
    order = list(range(rows))
    random.Random(f"nanoverl_async.data:{seed}:{epoch}").shuffle(order)
    return order


class DatasetPrompts:
    """prompt_fn(index) over verl-format files, shuffled per epoch (see the module invariants)."""

    def __init__(self, files: list[str], seed: int, skip: Collection[str] = ()):
        self.files = [str(Path(f).resolve()) for f in files]
        self.seed = seed
        self.skip = frozenset(skip)

    @functools.cached_property
    def samples(self) -> list[dict]:
        return load_samples(self.files, self.skip)

    def __call__(self, index: int) -> dict:
        epoch, position = divmod(index, len(self.samples))
        row = epoch_order(len(self.samples), self.seed, epoch)[position]
        return {**self.samples[row], "index": index, "row": row}


def prompt_source(data: DataConfig, seed: int) -> Callable[[int], dict]:
    """The buffer's prompts, index -> sample: data.train_files (verl format) when set, else data.task, a
    `make_prompt(seed, index)` function (`builtin:multiply`, `module:fn` or `file.py:fn`)."""
    if data.train_files:
        return DatasetPrompts(data.train_files, seed, data.skip_rows)
    make_prompt = load_object(data.task, "data.task")

    def prompt(index: int) -> dict:
        try:
            return make_prompt(seed, index)
        except Exception as error:  # noqa: BLE001 - user code: reported with its own frames
            raise user_error(f"data.task {data.task}", error) from error
    return prompt
