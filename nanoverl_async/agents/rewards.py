"""verl-style reward functions: `compute_score(data_source, solution_str, ground_truth, extra_info)`.

    reward_fn = load_reward("my_reward.py", "compute_score")      # reward.path, reward.name
    reward, info = await score_sample(reward_fn, sample, "The answer is \\boxed{42}.")

A reward function returns a float, or a dict with a "score" entry (its other numeric entries are kept in
trajectory.info["reward_info"]); it may be sync or async. Samples carry verl's fields: `data_source`,
`reward_model.ground_truth`, `extra_info` (nanoverl_async/agents/data.py). The default, `math_compute_score`,
checks the last \\boxed{...} (or the whole answer) against the ground truth with the `math-verify`
package (a dependency), then by an exact match of the normalised strings.

Invariants: the reward is a finite float. A function returning NaN, inf, None, a bool, text or a dict
without a finite "score" raises a UserCodeError naming it and where it is defined (file:line); one that
raises, or hangs past agent.hook_timeout_s, names it and the line. So a broken scorer fails the run loudly
instead of training on it, and the error is the function's, not the step() of the environment calling it.
A sample without a ground truth is still scored (against None: a custom function may not need one), and its
reward info says so (`MISSING_GROUND_TRUTH`), so that metrics.py can count such episodes and warn when they
earn nothing.

Run alone: `python -m pytest tests/test_env_data.py -q`.
"""

from __future__ import annotations

import math
import numbers
import re
import threading
from typing import Any, Callable, Optional

from nanoverl_async.agents.user_code import broken_contract, call_user, load_object

MISSING_GROUND_TRUTH = "ground_truth_missing"  # reward info of an episode whose sample had no ground truth


def load_reward(path: str, name: str = "compute_score") -> Optional[Callable]:
    """The reward function at `path` (a .py file or a module) named `name`; None when path is ""."""
    return load_object(f"{path}:{name}") if path else None


def last_boxed(text: str) -> Optional[str]:
    """The content of the last \\boxed{...} in `text` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def _normalise(text: str) -> str:
    return re.sub(r"\s+", "", text).rstrip(".").strip("$")


def math_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 if the answer (last \\boxed{...}, else the whole text) equals the ground truth mathematically."""
    answer = last_boxed(solution_str)
    answer = solution_str if answer is None else answer
    from math_verify import parse, verify  # here, not at the top: it imports sympy, which only scoring needs
    # math-verify's timeouts use signal.alarm, which works only in the main thread (it raises elsewhere); a
    # reward function runs on a user-code thread (user_code.call_user), so there they are off, and
    # agent.hook_timeout_s bounds it instead.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold, predicted = (parse(f"${text}$", parsing_timeout=timeout) for text in (ground_truth, answer))
    if gold and predicted and verify(gold, predicted, timeout_seconds=timeout):
        return 1.0
    return float(_normalise(answer) == _normalise(str(ground_truth)))


def is_reward(value: Any) -> bool:
    """A finite real number (numpy's too), but not a bool: True is a comparison someone forgot to float()."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


async def score_sample(reward_fn: Optional[Callable], sample: dict, solution_str: str) -> tuple[float, dict]:
    """Call a verl-style reward function on one sample -> (reward, extra numeric info). It runs within the bound
    of the hook that calls it (agent.hook_timeout_s, for an environment's step: user_code.call_user)."""
    fn = reward_fn or math_compute_score
    hook = f"reward function {getattr(fn, '__name__', fn)}"
    ground_truth = (sample.get("reward_model") or {}).get("ground_truth", sample.get("answer"))
    result = await call_user(hook, fn, sample.get("data_source", ""), solution_str, ground_truth,
                             sample.get("extra_info") or {})
    info: dict = {} if ground_truth is not None else {MISSING_GROUND_TRUTH: 1.0}
    score = result.get("score") if isinstance(result, dict) else result
    if not is_reward(score):  # the function's own error, not the step() of the environment that called it
        raise broken_contract(hook, fn, result, "return a finite number, or a dict with a finite number as 'score'")
    if isinstance(result, dict):
        info.update({k: float(v) for k, v in result.items() if k != "score" and is_reward(v)})
    return float(score), info
