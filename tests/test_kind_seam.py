"""Drafter kinds are a seam (dspark/kinds/): every stage asks the kind, no module outside dspark/kinds/ compares a
kind's name, the kinds import no stage, and each kind keeps the rules the stages used to spell out themselves.

Fast: nothing is trained here (tests/test_kinds.py trains each kind end to end).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from dspark.core.errors import InputError
from dspark.kinds import DEFAULT_KIND, KINDS, Kind, kind_of, serving_kind, vllm_methods

ROOT = Path(__file__).resolve().parents[1]
KINDS_DIR = ROOT / "dspark" / "kinds"
STAGES = ("cli", "connector", "data", "decode", "eval", "export", "extract", "serving", "tracking", "train")


def kind_literals(source: str, names, where: str = "<source>") -> list[str]:
    """`where:line: code` for each kind name used as a dispatch key in `source`: compared (==, !=, in, is, alone
    or in a tuple, list or set), a dict literal's key, a subscript (`KINDS["eagle3"]`, `Literal["dspark", ...]`),
    a `case`, a parameter's default or a `.get`/`.setdefault`/`.pop` default. Other strings equal to a kind's name
    (the package's in `files("dspark")`, a value such as `"owned_by": "dspark"`) are not dispatch."""
    names = set(names)

    def named(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names if isinstance(node.value, str) else False
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(named(e) for e in node.elts)
        return False

    tree = ast.parse(source, where)
    found = []
    for node in ast.walk(tree):
        hits = []
        if isinstance(node, ast.Compare):
            hits = [n for n in (node.left, *node.comparators) if named(n)]
        elif isinstance(node, ast.Dict):
            hits = [k for k in node.keys if k is not None and named(k)]
        elif isinstance(node, ast.Subscript) and named(node.slice):
            hits = [node.slice]
        elif isinstance(node, ast.MatchValue) and named(node.value):
            hits = [node.value]
        elif isinstance(node, ast.arguments):
            hits = [d for d in (*node.defaults, *node.kw_defaults) if d is not None and named(d)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("get", "setdefault", "pop") and len(node.args) == 2 and named(node.args[1]):
            hits = [node.args[1]]
        found += [(h.lineno, f"{where}:{h.lineno}: {ast.get_source_segment(source, node) or ast.unparse(node)}")
                  for h in hits]
    return [text for _, text in sorted(found)]


def test_no_module_outside_dspark_kinds_dispatches_on_a_kind_name():
    found = [hit for p in sorted((ROOT / "dspark").rglob("*.py")) if KINDS_DIR not in p.parents
             for hit in kind_literals(p.read_text(), KINDS.names(), str(p.relative_to(ROOT)))]
    assert not found, "kind names compared outside dspark/kinds/ (ask the kind: an attribute or a method of Kind):\n" \
        + "\n".join(found)


def test_the_walker_catches_kind_comparisons_and_passes_other_uses_of_the_same_strings():
    caught = '''
if cfg.speculator_type == "eagle3": pass
if kind.name != "eagle3": pass
if method == "dspark": pass
if method in ("dflash", "dspark"): pass
LOSS = {"eagle3": "kl_div"}
model = KINDS["eagle3"].model_class
method: Literal["auto", "dspark", "ngram"] = "auto"
def serve(method="dspark"): pass
kind = config.get("speculators_model_type", "dflash")
match kind:
    case "eagle3": pass
'''
    passed = '''
version = files("dspark") / "assets"
reply = {"object": "list", "owned_by": "dspark"}
pkgs = ("dspark", "torch")
line = ", ".join(k for k in ("dspark", "speculators") if k in versions)
tracking_project: str = setting("dspark", "the project")
@click.version_option(package_name="dspark")
def main(): pass
if kind.name == other.name: pass
'''
    hits = kind_literals(caught, KINDS.names())
    assert [h.split(":")[1] for h in hits] == [str(n) for n in (2, 3, 4, 5, 6, 7, 8, 9, 10, 12)], hits
    assert kind_literals(passed, KINDS.names()) == []


def test_the_kinds_import_no_stage_at_any_level():
    """Function-level imports count too (tests/test_architecture.py's rule): the stages import the kinds."""
    found = []
    for p in sorted(KINDS_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{p.relative_to(ROOT)}:{node.lineno}: {m}" for m in modules
                      if m.split(".")[:2] in [["dspark", s] for s in STAGES]]
    assert not found, "\n".join(found)


def test_loading_every_kind_and_the_train_settings_imports_neither_torch_nor_speculators():
    """The CLI's choices and a settings check cost no heavy import: the kinds name their classes as strings."""
    code = ("import sys; from dspark.kinds import KINDS; [KINDS[n].unread_settings() for n in KINDS]; "
            "from dspark.train.config import TrainConfig; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'speculators') "
            "or m.startswith(('dspark.decode', 'dspark.eval', 'dspark.export', 'dspark.serving'))))")
    # a child: what a fresh interpreter imports is the claim
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_registering_a_kind_name_twice_is_refused():
    class Again(Kind):
        name = DEFAULT_KIND

    KINDS[DEFAULT_KIND]  # its module loaded (the names are known before: lazily)
    with pytest.raises(ValueError, match=f"drafter kind '{DEFAULT_KIND}' is registered twice"):
        KINDS.register(Again.name, Again())


def test_a_config_naming_a_kind_dspark_does_not_know_is_one_line():
    with pytest.raises(InputError, match=r"ckpt/config.json holds a 'medusa' drafter") as e:
        kind_of({"speculators_model_type": "medusa"}, "ckpt/config.json")
    assert e.value.fix == "dspark reads the kinds ['dflash', 'dspark', 'eagle3']"


def test_each_kind_keeps_its_settings_rules():
    dspark_only = {"markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                   "confidence_head_alpha"}
    eagle3_only = {"ttt_steps", "ttt_step_loss_decay"}
    block_only = {"block_size", "sample_from_anchor", "max_anchors", "dflash_decay_gamma", "mask_token_id",
                  "per_position_loss_weight", "dpace_alpha"}
    assert KINDS["dspark"].unread_settings() == eagle3_only
    assert KINDS["dflash"].unread_settings() == dspark_only | eagle3_only
    assert KINDS["eagle3"].unread_settings() == dspark_only | block_only
    assert {n: (k.sample_from_anchor, k.default_loss, k.blocks) for n, k in KINDS.items()} == {
        "dspark": (True, '{"ce": 0.1, "tv": 0.9}', True), "dflash": (False, '{"ce": 0.1, "tv": 0.9}', True),
        "eagle3": (False, "kl_div", False)}


def test_each_vllm_method_is_one_kinds_and_serve_draft_offers_them_with_the_baselines():
    from dspark.serving.serve_draft import ServeDraftConfig

    assert vllm_methods() == ("dspark", "dflash", "eagle3")
    assert all(serving_kind(k.vllm_method) is k for _, k in KINDS.items())
    method = typing.get_type_hints(ServeDraftConfig)["method"]
    assert typing.get_args(method) == ("auto", "dspark", "dflash", "eagle3", "ngram", "none")
    with pytest.raises(InputError, match="no drafter kind is served by vLLM's method 'medusa'"):
        serving_kind("medusa")
