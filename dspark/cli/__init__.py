"""The `dspark` command line: the only user of click; one thin command per typed config.

Each command builds its configs from options the configs' settings generate, then runs them; heavy modules
(torch, vLLM) load only inside a command.

Imports: any.
"""

from dspark.cli import data, evaluate, extract, serving, train  # noqa: F401  (each registers its commands)
from dspark.cli.app import main

__all__ = ["main"]
