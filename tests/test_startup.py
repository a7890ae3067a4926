"""Imports that cost only when used: `--help`, `train --print-config` and the refusal of a bad setting load none of
torch, transformers, speculators, vLLM, matplotlib or the trackers; and the names a setting is checked against
without speculators are speculators' own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import typing

import pytest

from dspark.train.config import LOSS_FNS, MARKOV_HEAD_TYPES, check_loss_fn

HEAVY = ("torch", "transformers", "speculators", "vllm", "matplotlib", "mlflow", "wandb", "tensorboard", "trackio")
REQUIRED = ["--data-path", "p", "--verifier-name-or-path", "v", "--save-path", "s", "--target-layer-ids", "1", "3"]

# (argv, exit code): run in a folder where none of the paths named exists
CASES = [
    (["--help"], 0),
    *[([*cmd.split(), "--help"], 0) for cmd in (
        "train", "prepare", "extract", "eval", "compare", "export", "bench", "serve-draft", "regenerate", "holdout",
        "longbench", "toy-verifier", "replay", "store info")],
    (["train", *REQUIRED, "--print-config"], 0),
    (["train", *REQUIRED, "--loss-fn", "bogus"], 2),
    (["train", *REQUIRED, "--loss-fn", '{"xx": 1}'], 2),
    (["train", *REQUIRED, "--block-size", "0"], 2),
    (["train", *REQUIRED, "--logger", "bogus"], 2),
    (["train", *REQUIRED], 2),  # verifier v is no folder
    (["prepare", "--model", "m", "--data", "d", "--output", "o"], 2),
    (["extract", "--model", "m", "--data", "d", "--target-layer-ids", "1", "3"], 2),
    (["eval", "--checkpoint", "c"], 2),
    (["compare", "--drafter", "a=b"], 2),
    (["export", "c", "--output", "o", "--verifier-name", "V"], 2),
    (["bench", "--endpoint", "x", "--prompts", "p"], 2),
    (["serve-draft", "--verifier", "v", "--method", "dspark", "--print-only"], 2),
    (["regenerate", "--model", "m", "--data", "d", "--output", "o", "--dtype", "bogus"], 2),
    (["holdout", "--data", "d", "--train", "t", "--heldout-output", "h", "--heldout", "1"], 2),
    (["longbench", "--output", "o", "--per-length", "0"], 2),
    (["toy-verifier", "--steps", "-1"], 2),
    (["replay", "r"], 2),
    (["store", "info", "st"], 2),
]

CHILD = """
import json, sys
from click.testing import CliRunner
from dspark.cli import main
heavy, seen = json.loads(sys.argv[1]), set()
for argv, _ in json.loads(sys.argv[2]):
    r = CliRunner().invoke(main, argv)
    now = {m for m in heavy if m in sys.modules}
    print(json.dumps([argv, r.exit_code, sorted(now - seen), (r.output or "").strip().splitlines()[-1:]]))
    seen |= now
"""


def test_parsing_checking_and_refusing_import_nothing_heavy(tmp_path):
    # a subprocess: what a fresh interpreter imports is the claim (one child runs every case, in order)
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(HEAVY), json.dumps(CASES)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(CASES)
    for (argv, code, loaded, last), (_, expected) in zip(results, CASES):
        assert code == expected, (argv, code, last)
        assert not loaded, f"dspark {' '.join(argv)} imported {loaded}"


def test_the_kept_loss_names_are_speculators():
    from speculators.losses.utils import _LOSS_FN_MAPS  # its registry: one name -> loss map per implementation

    assert {impl: sorted(m) for impl, m in _LOSS_FN_MAPS.items()} == {impl: sorted(LOSS_FNS) for impl in _LOSS_FN_MAPS}


def test_the_kept_markov_head_types_are_speculators():
    from speculators.models.dspark import DSparkSpeculatorConfig

    field = DSparkSpeculatorConfig.model_fields["markov_head_type"]
    assert typing.get_args(field.annotation) == MARKOV_HEAD_TYPES


@pytest.mark.parametrize("spec", ["ce", "kl_div", '{"ce": 0.1, "tv": 0.9}', '{"lk_hybrid": 1}', "bogus", "{}",
                                  "[1]", '{"xx": 1}', '{"ce": "a"}', "1"])
def test_loss_specs_are_judged_as_speculators_judges_them(spec):
    from speculators.losses.utils import resolve_loss_config

    def verdict(check):
        try:
            check(spec)
        except ValueError as e:
            return str(e)
        return None

    assert verdict(check_loss_fn) == verdict(lambda s: resolve_loss_config(s, "eager"))
