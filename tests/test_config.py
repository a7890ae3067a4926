"""Every setting has one definition (TrainConfig and its nested configs): the CLI, --config files,
run records and the seed's own command lines (tests/test_card.py) all go through it."""

import json
import math
import resource
from dataclasses import MISSING
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from conftest import LAYERS, run_cli, run_process
from dspark.cli import main
from dspark.connector.config import MooncakeConfig
from dspark.extract.config import ServeLimits
from dspark.data.prepare import PreparedData
from dspark.core.settings import check_settings, checked, leaves, load_config_file, nest
from dspark.connector.manifest import default_store
from dspark.deployment import SECTIONS
from dspark.core.errors import InputError
from dspark.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ["--data-path", "p", "--verifier-name-or-path", "v", "--save-path", "s", "--target-layer-ids", "1", "3"]


def test_extract_and_train_meet_in_the_default_store(verifier, prepared, tmp_path):
    """Neither command is told where the store is: both name it from the verifier, layers and data."""
    layers = [str(x) for x in LAYERS]
    run_cli("extract", "--model", verifier, "--data", prepared, "--target-layer-ids", *layers, "--no-progress",
            cwd=tmp_path)
    out = run_cli("train", "--config", ROOT / "scripts/configs/demo.yaml", "--data-path", prepared,
                  "--verifier-name-or-path", verifier, "--save-path", "run", "--max-steps", "2",
                  "--total-seq-len", "512", "--no-progress", cwd=tmp_path)
    store = default_store(verifier, LAYERS, PreparedData(prepared).fingerprint)
    assert store.startswith("cache/stores/tiny-L1-3-5-")
    assert json.loads((tmp_path / "run/config.json").read_text())["train"]["store"] == store
    assert json.loads(out.stdout)["steps"] == 2


def test_a_config_file_sets_defaults_that_flags_override(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 0.005\nepochs: 3\ntarget_layer_ids: [2, 4]\nlive:\n  mooncake:\n    master: h:1\n")
    out = run_cli("train", "--config", path, *REQUIRED[:6], "--lr", "0.01", "--print-config")
    cfg = TrainConfig.from_dict(json.loads(out.stdout))
    assert (cfg.lr, cfg.epochs, cfg.target_layer_ids, cfg.live.mooncake.master) == (0.01, 3, [2, 4], "h:1")

    as_json = tmp_path / "c.json"
    as_json.write_text(out.stdout)  # what --print-config prints is a config file
    again = run_cli("train", "--config", as_json, "--print-config")
    assert json.loads(again.stdout) == json.loads(out.stdout)


@pytest.mark.parametrize("text, error", [
    ("lrr: 1\n", "unknown setting 'lrr' in {path} (fix: did you mean 'lr'?)"),
    ("live:\n  mooncake:\n    mastr: x\n", "unknown setting 'live.mooncake.mastr' in {path} (fix: did you mean 'master'?)"),
    ("live: 3\n", "live in {path} must be a mapping"),
    ("lr: [1\n", "config file {path} is not valid YAML (line 2)"),
    ("- 1\n", "config file {path} must hold a mapping of settings"),
])
def test_a_bad_config_file_is_one_line(tmp_path, text, error):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    proc = run_cli("train", "--config", path, *REQUIRED, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: " + error.format(path=path)), proc.stderr


@pytest.mark.parametrize("flags, error", [
    (["--block-size", "0"], "error: --block-size 0 must be >= 1"),
    (["--lr", "-1"], "error: --lr -1.0 must be > 0"),
    (["--loss-fn", "notjson"], "error: --loss-fn 'notjson': Unknown loss function 'notjson'"),
    (["--loss-fn", '{"xx":1}'], "error: --loss-fn '{\"xx\":1}': Unknown loss function 'xx'"),
    (["--max-steps", "0"], "error: --max-steps 0 must be >= 1"),
    (["--request-timeout", "0"], "error: --request-timeout 0.0 must be > 0"),
])
def test_impossible_training_settings_are_one_line(flags, error):
    proc = run_cli("train", *REQUIRED, *flags, "--print-config", check=False)
    assert proc.returncode == 2 and proc.stderr.startswith(error), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_batch_tokens_zero_is_refused(verifier, prepared):
    """Extraction's bounds are settings too: one line, as training's (click's usage block before the redesign)."""
    proc = run_cli("extract", "--model", verifier, "--data", prepared, "--target-layer-ids", "1",
                   "--batch-tokens", "0", check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --batch-tokens 0 must be >= 1"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_draft_vocabulary_larger_than_the_verifiers_is_refused(store, prepared, verifier, tmp_path):
    proc = run_cli("train", "--store", store, "--data-path", prepared, "--verifier-name-or-path", verifier,
                   "--save-path", tmp_path / "run", "--target-layer-ids", *map(str, LAYERS), "--total-seq-len", "512",
                   "--draft-vocab-size", "1000000", "--no-progress", check=False)
    assert proc.returncode == 2
    assert "error: --draft-vocab-size 1000000 is larger than the verifier's vocabulary" in proc.stderr


def test_run_records_and_files_refuse_unknown_keys(tmp_path):
    base = {"data_path": "p", "verifier_name_or_path": "v", "save_path": "s", "target_layer_ids": [1]}
    with pytest.raises(InputError, match=r"unknown setting 'endpont' in rec.live \(fix: did you mean 'endpoint'"):
        TrainConfig.from_dict({**base, "live": {"endpont": "x"}}, "rec")
    old_style = TrainConfig.from_dict({**base, "live": {"endpoint": "http://x", "mooncake": {"master": "m:1"}}})
    assert (old_style.live.endpoint, old_style.live.mooncake.master) == ("http://x", "m:1")
    (tmp_path / "c.json").write_text(json.dumps({"data_path": "p", "epochs": 2}))
    assert load_config_file(tmp_path / "c.json", TrainConfig) == {"data_path": "p", "epochs": 2}


def _float_options(group, path=()):
    """(command words, option) for every float option of every command, found by walking the CLI."""
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _float_options(cmd, (*path, name))
        for p in cmd.params:
            if isinstance(p, click.Option) and isinstance(p.type, click.types.FloatParamType):
                yield (*path, name), p.opts[0]


FLOAT_OPTIONS = sorted(set(_float_options(main)))


def test_the_cli_has_the_float_options_the_issue_names():
    flags = {flag for _, flag in FLOAT_OPTIONS}
    assert {"--lr", "--dflash-decay-gamma", "--max-grad-norm", "--checkpoint-freq", "--temperature",
            "--confidence-threshold", "--tolerance", "--request-timeout", "--client-timeout"} <= flags


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("words, flag", FLOAT_OPTIONS, ids=[f"{' '.join(w)} {f}" for w, f in FLOAT_OPTIONS])
def test_every_float_option_refuses_nan_and_infinity_before_anything_runs(words, flag, value):
    """NaN passes every `<`/`>` bound; refused while parsing, before any other option or file is looked at."""
    r = CliRunner().invoke(main, [*words, flag, value])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output  # no traceback
    assert r.output.startswith(f"error: {flag} {value} must be a finite number"), r.output
    assert len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("name, text, error", [
    ("c.yaml", "lr: .nan\n", "--lr nan"),
    ("c.yaml", "max_grad_norm: .inf\n", "--max-grad-norm inf"),
    ("c.yaml", "live:\n  mooncake:\n    linger_seconds: -.inf\n", "--mooncake-linger-seconds -inf"),
    ("c.yaml", "epochs: .inf\n", "--epochs inf"),  # an int setting: was an OverflowError traceback
    ("c.json", '{"dflash_decay_gamma": NaN}', "--dflash-decay-gamma nan"),
])
def test_nan_and_infinity_in_a_config_file_are_one_line(tmp_path, name, text, error):
    path = tmp_path / name
    path.write_text(text)
    proc = run_cli("train", "--config", path, *REQUIRED, "--print-config", check=False)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr.startswith(f"error: {error} must be a finite number"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_python_callers_get_the_same_finite_rule():
    base = dict(data_path="p", verifier_name_or_path="v", save_path="s", target_layer_ids=[1])
    with pytest.raises(InputError, match=r"^--lr nan must be a finite number \(fix: pass a finite value"):
        TrainConfig(**base, lr=math.nan).validate()
    with pytest.raises(InputError, match=r"^--checkpoint-freq inf must be a finite number"):
        TrainConfig(**base, checkpoint_freq=math.inf).validate()
    with pytest.raises(InputError, match=r"^--client-timeout inf must be a finite number"):
        ServeLimits(client_timeout=math.inf)
    with pytest.raises(InputError, match=r"^--mooncake-put-timeout nan must be a finite number"):
        check_settings(MooncakeConfig(put_timeout=math.nan), ("mooncake",))


def test_a_config_file_larger_than_1_mib_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# padding\n" * 110_000 + "lr: 0.01\n")  # 1.1 MB of comments: valid YAML
    proc = run_cli("train", "--config", path, *REQUIRED, "--print-config", check=False)
    assert proc.returncode == 2, proc.stdout[:200]
    assert proc.stderr.startswith(f"error: config file {path} is 1100009 bytes, more than the 1048576 it may be"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def _at_most_1_5_gib():
    resource.setrlimit(resource.RLIMIT_AS, (3 << 29, 3 << 29))


def test_a_yaml_alias_bomb_in_a_config_file_is_refused_unexpanded(tmp_path):
    """Nine nested aliases of nine are 9**9 ints: refused as written, never expanded (memory capped, time bounded)."""
    levels = ["  - &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    levels += [f"  - &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    path = tmp_path / "bomb.yaml"
    path.write_text("target_layer_ids:\n" + "\n".join(levels) + "\n")
    proc = run_process("train", "--config", path, *REQUIRED[:6], "--print-config", check=False,
                       why="a memory cap holds for a whole process", preexec_fn=_at_most_1_5_gib, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.startswith(f"error: config file {path} uses a YAML alias (*l0, line 3)"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


# --- deployment files (configs/*.yaml): a section per command, `shared:` settings where a command has them ----


def section(path, name: str) -> dict:
    """Command `name`'s settings in the deployment file `path`, as its `--config` reads them."""
    return load_config_file(path, SECTIONS[name], name, SECTIONS)


def test_a_deployment_file_gives_each_command_its_section_over_the_shared_settings(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("shared:\n  target_layer_ids: [2, 4]\n  mooncake: {local_buffer_gib: 0.75, writer_threads: 3}\n"
                 "train:\n  epochs: 5\n  live: {mooncake: {writer_threads: 6}}\nprepare: {seq_length: 128}\n")
    assert section(f, "train") == {
        "target_layer_ids": [2, 4], "live__mooncake__local_buffer_gib": 0.75, "live__mooncake__writer_threads": 6,
        "epochs": 5}
    assert section(f, "launch-vllm") == {
        "target_layer_ids": [2, 4], "sink__mooncake__local_buffer_gib": 0.75, "sink__mooncake__writer_threads": 3}
    assert section(f, "prepare") == {"seq_length": 128}  # it has no shared setting
    assert section(f, "mooncake-master") == {}
    cfg = TrainConfig.from_dict({**nest(section(f, "train")), "data_path": "p",
                                 "verifier_name_or_path": "v", "save_path": "s"})
    assert (cfg.epochs, cfg.live.mooncake.writer_threads, cfg.live.mooncake.local_buffer_gib) == (5, 6, 0.75)


def test_a_deployment_file_refuses_unknown_sections_and_commands_it_has_none_for(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("shared: {target_layer_ids: [1]}\ntrian: {epochs: 5}\n")
    with pytest.raises(InputError, match=r"unknown section\(s\) \['trian'\]"):
        section(f, "train")
    f.write_text("train: {epochs: 5}\n")
    proc = run_cli("compare", "--config", f, check=False)
    assert proc.returncode == 2
    assert "is a deployment file, with no section for this command" in proc.stderr
    f.write_text("train: {epohcs: 5}\n")
    with pytest.raises(InputError, match="unknown setting 'epohcs'"):
        section(f, "train")


def test_a_shared_setting_no_command_has_is_refused_not_skipped(tmp_path):
    """Each command takes the shared settings it has, so a misspelt one would reach none of them."""
    f = tmp_path / "d.yaml"
    f.write_text("shared: {target_layer_idz: [1]}\nprepare: {seq_length: 128}\n")
    for name in SECTIONS:  # prepare has no layer ids, and is told all the same
        with pytest.raises(InputError, match=r"'shared.target_layer_idz'.*did you mean 'target_layer_ids'"):
            section(f, name)
    f.write_text("shared: [1]\n")
    proc = run_cli("train", "--config", f, "--print-config", check=False)
    assert proc.returncode == 2
    assert "shared in" in proc.stderr and "must be a mapping" in proc.stderr
    assert "target_layer_ids: [1, 3]" in proc.stderr  # an example, not one command's field list


def test_the_deployment_sections_are_the_commands_that_take_a_config_file():
    with_config = {name for name, cmd in main.commands.items() if any(p.name == "config_file" for p in cmd.params)}
    assert set(SECTIONS) - {"launch-vllm"} <= with_config  # launch-vllm parses its own argv (argparse)


DEPLOYMENTS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", DEPLOYMENTS, ids=[p.name for p in DEPLOYMENTS])
def test_each_shipped_deployment_builds_every_command_and_writes_no_default(path):
    """A value equal to its setting's default would be a second copy of that default."""
    for name, cls in SECTIONS.items():  # a shared setting no command has would fail here
        flat = section(path, name)
        defaults = {"__".join(leaf.path): leaf.default for leaf in leaves(cls)}
        assert not [k for k, v in flat.items() if v == defaults[k]], f"{name} repeats defaults"
        required = {"__".join(leaf.path): [1] if "list" in str(leaf.hint) else "x"
                    for leaf in leaves(cls) if leaf.default is MISSING}
        checked(cls, {**required, **flat}, str(path))
