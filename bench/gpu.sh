#!/bin/bash
# Every GPU check of the speed work, each step with its own time limit, logs in OUTDIR:
#   [STEPS="tests attention async learner engine"] bash bench/gpu.sh [OUTDIR]
# (from the repository root; python3 must import torch with CUDA). The steps, in this order:
# - tests: tests/test_cuda.py, the engine (CUDA graphs included) and NCCL learner ranks (float32; bfloat16 over
#   FSDP2) against references;
# - attention: the engine's attention variants, eager and replayed from a CUDA graph (bench/attention_kernels.py);
# - async: async vs sync on the default job with the 0.5B body on the tiny model's tokenizer (random weights:
#   samples/s counts, rewards do not; ASYNC_MODEL=qwen_1_5b_body_with_tiny_tokenizer: the 1.5B body), generator and learner sharing the GPU, 15 steps, with ASYNC_OVERRIDES
#   (default: two interleaved repeats, learner.ppo_epochs=4, four passes over each batch, so that training is
#   some 40% of a synchronous step; with one pass the job waits on generation for 85% of a step); each run's
#   metrics.jsonl, kept also when the step is cut by its limit (per-step times of the steps that ran);
# - learner: LearnerRank.update vs the bare loop on the Qwen2.5-0.5B shape (64 x 1,024 tokens, bf16 over fp32
#   weights), with one profiled update of each (GPU busy time, host waits);
# - engine: the engine vs bare model.generate on the same shape (C = 64, 256, multi-turn), with and without CUDA
#   graphs, and where its host waits for the GPU per engine step (one wait per step by design).
# - kv (issue 31): the paged engine at scale beside static-cache compiled generate (bench/engine_at_scale.py;
#   SHAPES, default 0.5b; one shape a call);
# - scale (issue 32): the learner at the Qwen2.5 shapes, with and without activation checkpointing and chunked
#   logits, 4k and 16k tokens per micro-batch (bench/scale.py; SIZES, default 0.5b,1.5b,3b; 7b in a call of its own).
# - lora (issue 41): the 7B shape with LoRA (rank 16, all-linear) on one GPU (bench/scale.py --lora 16; SIZES,
#   default 7b): the base frozen in bfloat16, adapters and their AdamW state the only trained state;
# - trl (issue 32): nanoverl-async vs TRL's GRPOTrainer, both on the GPU, on the default job with the Qwen2.5-0.5B
#   body (bench/vs_trl.py --device cuda; TRL travels in the kit).
# Not in the default STEPS: kv, scale, lora and trl each want a call of their own.
# All of them take some 11 minutes on one H200, more than one device call: split them with STEPS. Each step stops
# at its own limit or at the call's deadline (DEADLINE_S, 575 s after the start), whichever comes first. Python
# output is unbuffered so that a step cut short still logs.
# On the lent machines, which lack Ray and a few more, build the kit first (bench/gpu_kit.sh) and carry .dev.
set -u
out=${1:-outputs/bench/gpu}
mkdir -p "$out"
if [ -f .dev/site.tgz ]; then
    mkdir -p /tmp/site && tar xzf .dev/site.tgz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
started=$(date +%s)
deadline=$(( started + ${DEADLINE_S:-575} ))
step() { echo "== $1 at $(( $(date +%s) - started )) s"; }
want() { [[ " ${STEPS:-tests attention async learner engine} " == *" $1 "* ]]; }
limit() { local left=$(( deadline - $(date +%s) )); echo $(( left < $1 ? (left > 1 ? left : 1) : $1 )); }
quiet="Loading|Writing|it/s\]"
if want tests; then
step tests
timeout -k 5 $(limit 75) python3 -m pytest -q tests/test_cuda.py 2>&1 | tee "$out/test_cuda.log" | tail -20
fi
if want attention; then
step attention
timeout -k 5 $(limit 45) python3 bench/attention_kernels.py --device cuda 2>&1 | tee "$out/attention.log"
fi
if want async; then
step async
rm -rf outputs/bench/async_vs_sync  # a warm machine keeps an earlier call's runs: bring back only these
timeout -k 5 $(limit 360) python3 bench/async_vs_sync.py model.path=bench/qwen_shape.py:${ASYNC_MODEL:-qwen_body_with_tiny_tokenizer} \
    model.dtype=bfloat16 learner.device=cuda generator.device=cuda learner.gpus_per_rank=0.5 \
    generator.gpus_per_replica=0.5 run.total_steps=15 agent.max_new_tokens=48 agent.max_total_tokens=192 \
    ${ASYNC_OVERRIDES:---repeats 2 learner.ppo_epochs=4} > "$out/async.log" 2>&1
grep -v -E "$quiet|logging.cc" "$out/async.log" | tail -25
pkill -9 -f 'ray::|raylet|gcs_server' 2>/dev/null  # a run cut by its limit leaves Ray's processes on the GPU
for run in outputs/bench/async_vs_sync/*/; do  # each run's per-step timings (not its weights)
    mkdir -p "$out/async_runs/$(basename "$run")" && cp "$run/metrics.jsonl" "$out/async_runs/$(basename "$run")/"
done
fi
if want learner; then
step learner
timeout -k 5 $(limit 110) python3 bench/learner_vs_torch.py --device cuda --model qwen0.5b --repeats 2 --updates 3 --profile 2>&1 \
    | grep -v -E "$quiet" | tee "$out/learner.log"
fi
if want engine; then
step engine
timeout -k 5 $(limit 600) python3 bench/engine_vs_generate.py --device cuda --model qwen0.5b --concurrency 64,256 --repeats 2 \
    --old-ref '' --max-wait 0 --profile 2>&1 | grep -v -E "$quiet" | tee "$out/engine.log"
fi
if want kv; then
step kv
timeout -k 5 $(limit 570) python3 bench/engine_at_scale.py --device cuda --shapes ${SHAPES:-0.5b} 2>&1 \
    | grep -v -E "$quiet" | tee "$out/engine_at_scale.log"
fi
if want lora; then
step lora
timeout -k 5 $(limit 570) python3 bench/scale.py --sizes ${SIZES:-7b} --lora 16 --tokens 4096,16384 2>&1 \
    | grep -v -E "$quiet" | tee "$out/lora.log"
fi
if want scale; then
step scale
timeout -k 5 $(limit 570) python3 bench/scale.py --sizes ${SIZES:-0.5b,1.5b,3b} 2>&1 | grep -v -E "$quiet" | tee "$out/scale.log"
fi
if want trl; then
step trl
timeout -k 5 $(limit 570) python3 bench/vs_trl.py --device cuda --trl-python python3 \
    --model bench/qwen_shape.py:qwen_body_with_tiny_tokenizer --steps ${TRL_STEPS:-30} --repeats 2 2>&1 \
    | grep -v -E "$quiet" | tee "$out/vs_trl.log"
fi
step done
