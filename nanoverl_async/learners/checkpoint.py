"""A learner rank's training state on disk: torch.distributed.checkpoint (DCP), sharded, every rank
writing and reading only its own shards.

    save_training_state(rank, "out/checkpoints/.step_4.tmp/learner")   # collective, on every rank
    load_training_state(rank, "out/checkpoints/step_4/learner")        # collective, on every rank

What is saved: the policy and its AdamW state, and, with algorithm.advantage=gae, the critic and its
optimizer. The frozen reference model is not: it is rebuilt from reference.path (or model.path).
`get_state_dict` / `set_state_dict` turn FSDP2's DTensor shards into DCP's format and back, so a checkpoint
written by N ranks loads into M ranks too (DCP reshards). Multi-node runs need `run.output_dir` on a
filesystem every rank sees. Fresh optimizers have no state yet; `get_state_dict` initialises it (a step
with lr 0) so DCP has tensors to load into.

Run alone: `python -m pytest tests/test_checkpoint.py -q -k learner` (1 and 2 ranks on gloo).
"""

from __future__ import annotations

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def _modules(learner) -> dict:
    """name -> (model, optimizer) of everything a rank trains."""
    pairs = {"policy": (learner.model, learner.optimizer)}
    if learner.critic is not None:
        pairs["critic"] = (learner.critic, learner.critic_optimizer)
    return pairs


def _state(learner) -> dict:
    state = {}
    for name, (model, optimizer) in _modules(learner).items():
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state[name] = {"model": model_state, "optimizer": optimizer_state}
    return state


def save_training_state(learner, path: str) -> None:
    """Collective: every rank writes its shards of models and optimizers under `path`."""
    dcp.save(_state(learner), checkpoint_id=path)


def load_training_state(learner, path: str) -> None:
    """Collective: every rank reads its shards from `path` into its models and optimizers, in place."""
    state = _state(learner)
    dcp.load(state, checkpoint_id=path)
    for name, (model, optimizer) in _modules(learner).items():
        set_state_dict(model, optimizer, model_state_dict=state[name]["model"],
                       optim_state_dict=state[name]["optimizer"])
