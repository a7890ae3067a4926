"""Reports: what a script reads (NAME.json), what a person reads (NAME.md), what they look at (NAME.png).

`dspark eval`, `eval --decode`, `compare` and `bench` write theirs through here, each file atomically;
a checkpoint's reports live in its EVAL_DIR, where `dspark export` finds them for the model card.
"""

from __future__ import annotations

import filecmp
from pathlib import Path

from dspark.core.fsio import replacing, write_atomic
from dspark.core.jsonio import dump_json

EVAL_DIR = "eval"  # CHECKPOINT/eval: the reports of that checkpoint


def belongs_to(report: dict, ckpt: Path) -> bool:
    """A report belongs to checkpoint `ckpt` when its `checkpoint` names it: the same folder, a folder with the
    same weights (a copied run), or, for a run folder moved since (the recorded one is gone), the same run name,
    `checkpoints` and step."""
    recorded, ckpt = report.get("checkpoint"), Path(ckpt).resolve()
    if not isinstance(recorded, str) or not recorded:
        return False
    rec = Path(recorded).expanduser()
    if rec.exists():
        rec = rec.resolve()
        return rec == ckpt or (rec / "model.safetensors").is_file() and \
            filecmp.cmp(rec / "model.safetensors", ckpt / "model.safetensors", shallow=False)
    return rec.is_absolute() and rec.parts[-3:] == ckpt.parts[-3:]


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
