"""The learner pool: FSDP2 ranks, batch packing, checkpoints, and weight pushes to SGLang."""
