"""The training stage: feature stores -> a DFlash drafter (DeepSpeed ZeRO, checkpoints, W&B).

train.py     the loop, read top to bottom      __main__.py    Hydra entry point (TrainConfig, DrafterConfig, train=auto)
drafter.py   the drafter's spec (from the stores) and first weights
store_check.py  the stores' layer ids and target against the drafter
store_verify.py the stores' checksums before step 1 (train.verify_store: full, sample, off)
data.py      store plans, rank sharding, prefetching
anchors.py   where blocks start                batch.py       padded micro-batches
masks.py     the [context | blocks] attention mask
objective.py embed -> drafter -> loss          loss.py        decayed block loss, accuracy, offline tau
engine.py    DeepSpeed setup, dtype, collectives
settings.py  the device-dependent settings, their auto resolved by device and said once
checkpoint.py atomic save/resume + HF export   metrics.py     sums on the device and over ranks, metrics.jsonl + W&B
"""
