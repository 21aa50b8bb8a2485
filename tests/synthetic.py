"""Hand-made multi-turn episodes for learner tests: prompt, sampled turns, tool results (mask 0)."""

import numpy as np

from nanoverl_async.wire.trajectory import Trajectory


def episodes(shapes, seed: int, group_size: int = 2, shared_prompts: bool = False) -> list[Trajectory]:
    """One trajectory per (prompt length, [sampled tokens per turn], reward); a 2-token tool result
    (mask 0) sits between turns; behaviour logprobs are random, versions 0 on sampled tokens. With
    shared_prompts the samples of a group have their first sample's prompt, as a generator's do."""
    rng = np.random.default_rng(seed)
    trajectories = []
    for index, (prompt, turns, reward) in enumerate(shapes):
        mask = [0] * prompt
        for turn, size in enumerate(turns):
            mask += ([0, 0] if turn else []) + [1] * size
        mask = np.array(mask, np.uint8)
        logprobs = np.where(mask == 1, -rng.uniform(3.5, 5.5, len(mask)), 0.0).astype(np.float32)
        trajectories.append(Trajectory(
            id=str(index), group_id=index // group_size, prompt_index=index // group_size,
            sample_index=index % group_size, token_ids=rng.integers(2, 100, len(mask)).astype(np.int32),
            loss_mask=mask, behaviour_logprobs=logprobs, versions=np.where(mask == 1, 0, -1).astype(np.int32),
            reward=reward))
        if shared_prompts and index % group_size:
            first = trajectories[index - index % group_size]
            assert shapes[index][0] == shapes[index - index % group_size][0], "a group's prompts have one length"
            trajectories[-1].token_ids[:prompt] = first.token_ids[:prompt]
    return trajectories
