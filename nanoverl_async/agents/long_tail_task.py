"""Built-in workload `builtin:long-tail`: one to three "A*B?" questions in a row, so episodes run 1 to 6 turns.

Why: real agent episodes are uneven, most short and a few long, and a synchronous step waits for its
longest. Here the number of questions k is drawn per prompt, 1 most often (P = 0.6, 0.25, 0.15 for
k = 1, 2, 3); the environment asks the next question after each answer (`Step(done=False)`), and each
answer takes one turn (direct) or two (a calculator call, then the answer). So an episode is 1 to 6 turns
and 10 to ~90 tokens. The questions, the calculator and the call format are `builtin:multiply`'s; the
reward is the share of the k questions answered exactly. The tiny model for it, `builtin:tiny-long-tail`
(configs/long_tail.yaml), is warm-started on demos of this format (models/tiny.py), since one that has
only seen one question does not find the second.

    <|user|>12*34?<|end|><|assistant|><call>12*34</call><res>408</res>408<|end|>
    <|user|>5*6?<|end|><|assistant|>30<|end|>                                   reward (1 + 1) / 2

Invariants: `make_prompt` is a pure function of (seed, index) and JSON-able; `demo` draws the same
distribution of questions from the warm start's generator.

Run alone: `python -m pytest tests/test_workloads.py -q -k long_tail`.
"""

from __future__ import annotations

import random

from nanoverl_async.agents.env import Step
from nanoverl_async.agents.multiply_task import MAX_OPERAND, MultiplyEnv

QUESTIONS, WEIGHTS = (1, 2, 3), (0.6, 0.25, 0.15)  # questions per episode and their probabilities


def questions(rng: random.Random) -> list[tuple[int, int]]:
    """k operand pairs, k drawn from QUESTIONS with WEIGHTS."""
    k = rng.choices(QUESTIONS, WEIGHTS)[0]
    return [(rng.randrange(MAX_OPERAND), rng.randrange(MAX_OPERAND)) for _ in range(k)]


def make_prompt(seed: int, index: int) -> dict:
    """The index-th sample: the first question in `messages`, all of them in `questions` with their `answers`."""
    pairs = questions(random.Random(f"nanoverl_async.long_tail:{seed}:{index}"))
    asked = [f"{a}*{b}?" for a, b in pairs]
    return {"index": index, "messages": [{"role": "user", "content": asked[0]}], "questions": asked,
            "answers": [str(a * b) for a, b in pairs]}


def demo(rng: random.Random) -> list[tuple[str, str, str, str]]:
    """One warm-start demo (models/tiny.py): (question, tool call, tool result, answer) per question."""
    return [(f"{a}*{b}?", f"{a}*{b}", str(a * b), str(a * b)) for a, b in questions(rng)]


class LongTailEnv(MultiplyEnv):
    """`builtin:multiply`'s calculator and format, asking the sample's questions one after another."""

    def __init__(self):
        self.answered = self.correct = 0

    async def step(self, sample: dict, message: dict) -> Step:
        answers = sample["answers"]
        self.correct += message["content"].strip() == answers[self.answered]
        self.answered += 1
        done = self.answered == len(answers)
        follow_up = [] if done else [{"role": "user", "content": sample["questions"][self.answered]}]
        # the share so far: the episode's reward if the next question leaves no room to answer (agent_loop.drive)
        return Step(reward=self.correct / len(answers), done=done, messages=follow_up)
