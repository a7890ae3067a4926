"""Teacher-forced evaluation of a checkpoint (teacher_forced.py) and its settings (config.py).

Imports: connector (the store), core, data, kinds, tracking, train (checkpoints, data, blocks).
"""
