"""The TRL half of bench/vs_trl.py: TRL 1.16's synchronous `GRPOTrainer` (its `tools=` multi-turn loop)
on nanoverl-async's default job, timed step by step.

    /work/trl-venv/bin/python bench/trl_side.py --steps 60 --out trl_steps.jsonl --summary trl_summary.json

Runs in its own virtual environment, so that TRL's pins never touch the project's:
    python3 -m venv /work/trl-venv
    /work/trl-venv/bin/pip install torch==2.13.0 trl==1.16.0 datasets omegaconf msgpack
(this repository's root is put on sys.path for `nanoverl_async`; omegaconf, and msgpack for the slow tool's
task, are the light dependencies that importing the task modules need besides torch and transformers). bench/vs_trl.py passes the job's
settings from configs/agent_grpo.yaml; the defaults below are the same numbers.

The same task: prompts `multiply_task.make_prompt(seed, i)` in index order, the cached `builtin:tiny` model
and tokenizer (`models.resolve_model_path`, `models.load_tokenizer`), the calculator tool, reward
`multiply_task.score` on the final answer, B prompts x G generations per step, AdamW (constant lr, no
weight decay), one optimizer step per batch, clip 0.2 / 0.28, grad norm 1, token-mean loss, no KL,
temperature 1, fp32. Turn limits as the project's agent loop: a turn stops at `<|end|>` or `</call>` or
after max_new_tokens; max_turns assistant turns = max_turns - 1 tool iterations (a turn that still calls
the tool after that gets reward 0, as in the project); the completion budget is max_total_tokens minus the
longest prompt (9 tokens), so TRL never gets more room than the project.

TRL needs these adaptations to run the tiny model's `<call>A*B</call>` format (found by reading
trl/trainer/grpo_trainer.py and trl/chat_template_utils.py of 1.16.0):
  1. tool list hidden in the template: TRL always renders prompts with `tools=`, and the tiny template would
     then prepend a `<|system|>tools: calculator(expression)<|end|>` line that the project's default job
     does not show (`MultiplyEnv.show_tools = False`); the header block is removed from TRL's copy.
  2. a tool-call branch for TRL's template probe: `supports_tool_calling` renders a call with sentinel
     name/argument key/value and requires all three in the text; the tiny template renders only
     `<call>{{ arguments.expression }}</call>`, so calls without an `expression` argument render as
     `<call>NAME{json arguments}</call>` (never reached in training, where every call has `expression`).
  3. tool-result suffix ids rendered as a delta: `GRPOTrainer._get_tool_suffix_ids` trims its prefix at the
     last EOS (for Qwen's `<|im_end|>\\n`), but this template ends a calling turn at `</call>` with no EOS,
     so the last EOS is the user turn's and the "suffix" came out as `<|assistant|><call></call><res>..</res>`;
     the subclass below returns render(history + tool messages) minus render(history): `<res>408</res>`.
  4. a response parser: `tokenizer.parse_response` is the project's own `tool_parsers.parse_builtin` (a turn
     ending in `</call>` is a call of `calculator(expression=...)`; anything else is a final answer). TRL calls
     it only when the tokenizer has a `response_template`, so the equivalent declarative template is set too
     (it alone would also treat an unclosed `<call>` cut by the token limit as a call, which the project does not).
  5. generation also stops at `</call>`: the model's generation_config lists it as an eos id, which TRL
     adds to its stop ids (otherwise the model would write its own `<res>` instead of calling the tool).

The slow tool (`--tool-median-s` > 0, from a config with `agent.env: builtin:slow-tool`): the same calculator
behind the project's lognormal delay (`slow_tool_task.delayed`, an `async def` tool: TRL gathers a
completion's calls on its event loop; it runs completions one after another), drawn from a generator seeded
with --seed.

Written files: --out, one JSON line per step {step, wall_s (since the first step began), reward_mean,
samples}; --summary, one JSON object: versions, timings, and the re-score: every episode's completion ids
are scored again the project's way (the final turn is the tokens after the last tool result; a turn ending
in `</call>` is an unanswered call, reward 0; else its text without `<|end|>` goes to `multiply_task.score`)
and compared with TRL's reward (`disagreements`), and TRL's prompt + completion ids are compared with the
project template's rendering of the same messages (`token_mismatches`; episodes with a malformed call, a
`</call>` without `<call>`, are counted apart in `malformed_calls`: no message renders those ids, and those
with a sampled byte that is not UTF-8 in `not_utf8`: it decodes to U+FFFD, which encodes to other ids; TRL
and the project both keep such ids as sampled). Both checks run after training, outside the timed loop.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # nanoverl_async from this checkout, not installed in TRL's venv

LONGEST_PROMPT_TOKENS = 9  # <|user|>99*99?<|end|><|assistant|>: the byte-level tokenizer has one token per char


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", required=True, help="per-step JSON lines")
    p.add_argument("--summary", required=True, help="one JSON object: versions, timings, re-score")
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999))
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--clip-low", type=float, default=0.2)
    p.add_argument("--clip-high", type=float, default=0.28)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=96)
    p.add_argument("--max-observation-chars", type=int, default=40)
    p.add_argument("--tool-median-s", type=float, default=0.0, help="the slow tool's median delay (0: instant)")
    p.add_argument("--tool-p99-s", type=float, default=0.0, help="its 99th percentile")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: the trainer's GPU (accelerate)")
    return p.parse_args(argv)


def trl_chat_template(template: str) -> str:
    """The tiny model's chat template with adaptations 1 and 2 (module docstring)."""
    header_start, header_end = "{%- if tools -%}", "{%- endfor -%}<|end|>{%- endif -%}"
    start = template.index(header_start)
    end = template.index(header_end, start) + len(header_end)
    template = template[:start] + template[end:]  # 1: no tools line
    call = "<call>{{ f.arguments if f.arguments is string else f.arguments.expression }}</call>"
    if call not in template:
        raise ValueError("the tiny model's chat template changed: update bench/trl_side.py")
    branch = ("{%- if f.arguments is string -%}<call>{{ f.arguments }}</call>"
              "{%- elif f.arguments.expression is defined -%}<call>{{ f.arguments.expression }}</call>"
              "{%- else -%}<call>{{ f.name }}{{ f.arguments | tojson }}</call>{%- endif -%}")
    return template.replace(call, branch)  # 2


# What transformers' own parser would do with this format; TRL needs a response_template to be set before it
# passes `prefix=` and `tools=` to `tokenizer.parse_response` (adaptation 4).
TINY_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": ["<|assistant|>", "</res>"],
    "fields": {
        "tool_calls": {"open": "<call>", "close": "</call>", "repeats": True, "content": "text",
                       "transform": {"type": "function",
                                     "function": {"name": "calculator", "arguments": {"expression": "{content}"}}}},
        "content": {"close": "<|end|>", "content": "text"},
    },
}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from nanoverl_async.agents import multiply_task
    from nanoverl_async.models.load import load_tokenizer, resolve_model_path
    from nanoverl_async.models.tiny import CALL_END, END, RES_END
    from nanoverl_async.agents.tool_parsers import parse_builtin

    datasets.disable_progress_bar()
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    project_template = tokenizer.chat_template  # what the project renders (without a tools line)
    tokenizer.chat_template = trl_chat_template(project_template)
    end_id, call_end_id, res_end_id = tokenizer.convert_tokens_to_ids([END, CALL_END, RES_END])

    def parse_response(self, response, schema=None, *, prefix=None, tools=None):  # adaptation 4
        text = self.decode(response, skip_special_tokens=False).removesuffix(END)
        content, calls = parse_builtin(text, "calculator", "expression")
        message = {"role": "assistant", "content": content}
        if calls:  # a malformed call gets an empty expression: the tool answers "error: malformed call"
            message["tool_calls"] = [{"type": "function", "function": {
                "name": "calculator", "arguments": {"expression": "" if c.error else c.arguments["expression"]}}}
                for c in calls]
        return message

    tokenizer.response_template = TINY_RESPONSE_TEMPLATE
    tokenizer.parse_response = types.MethodType(parse_response, tokenizer)

    max_chars = args.max_observation_chars

    def calculator(expression: str) -> str:
        """Evaluate one arithmetic operation on two non-negative integers.

        Args:
            expression: "A*B", "A+B" or "A-B" with non-negative integers A and B, e.g. "12*34".
        """
        # the project's tool, with the project's error observations (tools.call_tool, MultiplyEnv limits)
        if not expression.strip():
            return "error: malformed call"
        try:
            return multiply_task.calculator(expression)[:max_chars]
        except Exception as error:
            return f"error: {error}"[:max_chars]

    tool = calculator
    if args.tool_median_s > 0:  # builtin:slow-tool's calculator: the same delays, an `async def` tool
        from nanoverl_async.agents import slow_tool_task  # its agent loop needs msgpack: only for this task

        latency, rng = slow_tool_task.Lognormal(args.tool_median_s, args.tool_p99_s), random.Random(args.seed)
        tool = slow_tool_task.delayed(calculator, lambda: latency.sample(rng), blocking=False)

    class TinyGRPOTrainer(GRPOTrainer):
        def _get_tool_suffix_ids(self, tool_messages):  # adaptation 3: the chat-template delta
            call = {"type": "function", "function": {"name": tool_messages[0]["name"],
                                                      "arguments": {"expression": "1*1"}}}
            history = [{"role": "user", "content": "1*1?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
            kwargs = dict(tokenize=True, chat_template=self.chat_template, return_dict=False,
                          **self.chat_template_kwargs)
            before = self.processing_class.apply_chat_template(history, add_generation_prompt=False, **kwargs)
            after = self.processing_class.apply_chat_template(history + tool_messages, add_generation_prompt=True,
                                                              **kwargs)
            if after[: len(before)] != before:
                raise ValueError("the chat template is not prefix-preserving")
            return after[len(before):]

    # the project's prompt stream, in index order (16 a step, each repeated 8 times by TRL's sampler)
    samples = [multiply_task.make_prompt(args.seed, i) for i in range(args.steps * args.prompts_per_step)]
    dataset = datasets.Dataset.from_list([{"prompt": s["messages"], "answer": s["answer"]} for s in samples])

    step_rewards: list[float] = []
    episodes: list[tuple] = []  # (answer, prompt messages, completion messages, completion ids, TRL reward)

    def multiply_reward(prompts, completions, completion_ids, answer, **kwargs):
        rewards = []
        for prompt, messages, ids, expected in zip(prompts, completions, completion_ids, answer):
            last = messages[-1] if messages else {}
            final = last.get("role") == "assistant" and not last.get("tool_calls")  # else: calls left unanswered
            reward = multiply_task.score({"answer": expected}, last.get("content") or "") if final else 0.0
            rewards.append(reward)
            episodes.append((expected, prompt, messages, list(ids), reward))
        step_rewards.extend(rewards)
        return rewards

    rows: list[dict] = []

    class StepClock(TrainerCallback):
        t0 = None

        def on_step_begin(self, targs, state, control, **kwargs):
            if self.t0 is None:
                self.t0 = time.perf_counter()

        def on_step_end(self, targs, state, control, **kwargs):
            rows.append({"step": state.global_step, "wall_s": time.perf_counter() - self.t0,
                         "reward_mean": sum(step_rewards) / max(1, len(step_rewards)), "samples": len(step_rewards)})
            step_rewards.clear()

    batch = args.prompts_per_step * args.samples_per_prompt
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = [end_id, call_end_id]  # adaptation 5: turns stop at </call> too
    with tempfile.TemporaryDirectory(prefix="trl_side_") as scratch:
        config = GRPOConfig(
            output_dir=scratch, use_cpu=args.device == "cpu", bf16=args.dtype == "bfloat16", fp16=False, seed=args.seed,
            max_steps=args.steps, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
            num_generations=args.samples_per_prompt, num_iterations=1, shuffle_dataset=False,
            learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=args.weight_decay,
            adam_beta1=args.betas[0], adam_beta2=args.betas[1], max_grad_norm=args.grad_clip,
            beta=0.0, epsilon=args.clip_low, epsilon_high=args.clip_high, loss_type="dapo", scale_rewards="group",
            temperature=args.temperature, top_p=1.0, top_k=0,
            max_completion_length=args.max_total_tokens - LONGEST_PROMPT_TOKENS,
            generation_kwargs={"max_new_tokens": args.max_new_tokens},
            max_tool_calling_iterations=args.max_turns - 1,
            report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = TinyGRPOTrainer(model=model, reward_funcs=[multiply_reward], args=config, train_dataset=dataset,
                                  processing_class=tokenizer, tools=[tool], callbacks=[StepClock()])
        trainer.train()

    Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))

    # the re-score (after training: not in the loop; its seconds are reported so vs_trl.py can leave them out of
    # the process wall too)
    rescore_started = time.perf_counter()
    disagreements = token_mismatches = malformed = not_text = 0
    examples, mismatch_examples = [], []
    for expected, prompt, messages, ids, reward in episodes:
        rescored = project_reward(ids, expected, tokenizer, end_id, call_end_id, res_end_id, multiply_task.score)
        if rescored != reward:
            disagreements += 1
            if len(examples) < 5:
                examples.append({"answer": expected, "completion": tokenizer.decode(ids), "trl": reward,
                                 "project": rescored})
        if any(not c["function"]["arguments"]["expression"] for m in messages for c in m.get("tool_calls", ())):
            malformed += 1  # `...</call>` without `<call>`: no message renders it; TRL and the project keep its ids
            continue
        if tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"] != ids:
            not_text += 1  # a sampled byte that is not UTF-8 decodes to U+FFFD: text cannot give these ids back
            continue
        prompt_ids = tokenizer.apply_chat_template(prompt, chat_template=project_template,
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)
        rendered = tokenizer.apply_chat_template(prompt + messages, chat_template=project_template,
                                                 tokenize=True, return_dict=False)
        seen = list(prompt_ids) + ids
        if list(rendered[: len(seen)]) != seen:
            token_mismatches += 1
            if len(mismatch_examples) < 5:
                mismatch_examples.append({"trl": tokenizer.convert_ids_to_tokens(seen),
                                          "rendered": tokenizer.convert_ids_to_tokens(list(rendered))})
    rescore_s = time.perf_counter() - rescore_started
    summary = {
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "steps": len(rows), "episodes": len(episodes), "disagreements": disagreements,
        "token_mismatches": token_mismatches, "malformed_calls": malformed, "not_utf8": not_text, "disagreement_examples": examples,
        "token_mismatch_examples": mismatch_examples,
        "train_wall_s": rows[-1]["wall_s"] if rows else 0.0, "rescore_s": rescore_s,
        "tool_use_frac": sum(call_end_id in e[3] for e in episodes) / max(1, len(episodes)),
    }
    Path(args.summary).write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if not k.endswith("_examples")}))
    return 0


def project_reward(ids: list[int], expected: str, tokenizer, end_id: int, call_end_id: int, res_end_id: int,
                   score) -> float:
    """The reward the project's agent loop would give this token sequence: its final turn is what follows
    the last tool result; a turn ending in `</call>` is a call left unanswered (turn or length limit: 0)."""
    if ids and ids[-1] == call_end_id:
        return 0.0
    final = ids
    if call_end_id in ids:
        last_call = len(ids) - 1 - ids[::-1].index(call_end_id)
        rest = ids[last_call + 1:]
        final = rest[rest.index(res_end_id) + 1:] if res_end_id in rest else []
    if final and final[-1] == end_id:
        final = final[:-1]
    return score({"answer": expected}, tokenizer.decode(final, skip_special_tokens=False))


if __name__ == "__main__":
    sys.exit(main())
