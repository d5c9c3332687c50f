"""The training stage: feature stores -> a DFlash drafter (DeepSpeed ZeRO, checkpoints, W&B).

anchors.py  where blocks start          masks.py      the [context | blocks] attention mask
batch.py    padded micro-batches        loss.py       decayed block loss, accuracy, offline tau
data.py     store plans, rank sharding, prefetching   objective.py  embed -> drafter -> loss
engine.py   DeepSpeed setup             checkpoint.py atomic save/resume + HF export
metrics.py  metrics.jsonl + W&B         store_check.py  manifest vs drafter checks
train.py    the loop (`TrainConfig`, `train`)          __main__.py   Hydra entry point
"""
