"""The learner ranks: FSDP2, batch packing, checkpoints, and weight pushes to SGLang (controller/learner_pool.py
places them)."""
