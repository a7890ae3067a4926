"""Experiment trackers: a run's metrics, config and eval results in TensorBoard, MLflow, wandb or trackio.

    config.py    TrackingConfig: `--logger` and its settings (torch-free: the CLI is built from it)
    backends.py  one small class per tracker (config.py's TRACKERS registry finds it by name)
    run.py       the run's trackers: started, fed and closed off the training thread; eval logs into them

RUN/metrics.jsonl stays the record (replay compares it); trackers mirror it and never stop training.
Each tracker's own library loads lazily.

Imports: core.
"""
