"""Training: TrainConfig, data (split, pack, read-ahead), the drafter model, the loop and its checkpoints, and the
scoring of blocks as decoding drafts them with the state gain (blocks.py: validation's and `dspark eval`'s).

Imports: connector (the sources it reads), core, data, kinds, tracking, verifier.
"""
