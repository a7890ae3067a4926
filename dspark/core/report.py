"""Reports: what a script reads (NAME.json), what a person reads (NAME.md), what they look at (NAME.png).

`dspark eval`, `eval --decode`, `compare` and `bench` write theirs through here, each file atomically;
a checkpoint's reports live in its EVAL_DIR, where `dspark export` finds them for the model card.
"""

from __future__ import annotations

from pathlib import Path

from dspark.core.fsio import replacing, write_atomic
from dspark.core.jsonio import dump_json

EVAL_DIR = "eval"  # CHECKPOINT/eval: the reports of that checkpoint


def save_figure(fig, path: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    with replacing(path) as f:
        fig.savefig(f, dpi=110, format="png")
    plt.close(fig)


def write_report(result: dict, out: Path, name: str, markdown_fn, plot_fn, title: str) -> None:
    """NAME.json, NAME.md and NAME.png in `out`: what a script reads, what a person reads, what they look at."""
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / f"{name}.json", dump_json(result, indent=2))  # whole or not at all, as every result file
    write_atomic(out / f"{name}.md", markdown_fn(result))
    plot_fn(result, out / f"{name}.png", title)
