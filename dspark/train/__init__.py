"""Training: TrainConfig, data (split, pack, read-ahead), the drafter model, the loop and its checkpoints.

May import dspark.connector (the sources it reads), tracking, prepare, kinds and settings; never extract or the CLI.
"""
