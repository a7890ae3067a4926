"""Teacher-forced evaluation of a checkpoint (teacher_forced.py), and the files every report writes (report.py).

May import train (checkpoints, data), connector (the store), kinds, tracking and the ground floor; never decode or
the CLI.
"""
