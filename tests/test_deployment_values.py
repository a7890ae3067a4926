"""Values from a config or deployment file are typed exactly as the same setting's flag is (issue 41):
a YAML `true` is no port, a string no list, a key given twice no silent last-wins; and the settings that
speculators or the run's plan cannot take (a layer listed twice, 1e29 epochs) are one line up front."""

import json
from pathlib import Path

import pytest

from conftest import run_cli
from dspark.deployment import SECTIONS
from dspark.core.errors import InputError
from dspark.extract import launch
from dspark.extract.config import ExtractConfig, LaunchConfig, ServeConfig
from dspark.core.settings import base_type, checked, leaves, load_config_file, nest
from dspark.train.config import MAX_EPOCHS, TrainConfig

TRAIN = ["--data-path", "p", "--verifier-name-or-path", "v", "--save-path", "s"]


@pytest.fixture
def model(tmp_path) -> Path:
    """All the launcher reads of a verifier: its config.json."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": 16}))
    return tmp_path / "model"


def one_line(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        launch.main(argv, SECTIONS)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("text, error", [
    # was passed to vLLM as "-", "-", "e", ... (a string iterated as a list)
    ('launch-vllm: {vllm_args: "--enforce-eager --max-model-len 512"}',
     'launch-vllm.vllm_args is "--enforce-eager --max-model-len 512", expected a list of strings '
     '(fix: write a YAML list: `vllm_args: ["--enforce-eager", "--max-model-len", "512"]`)'),
    ("launch-vllm: {port: true}", "launch-vllm.port is true, expected an integer or null"),  # was --port True
    ('launch-vllm: {port: "abc"}', 'launch-vllm.port is "abc", expected an integer or null'),  # was a TypeError
    ("launch-vllm: {health_timeout: soon}", 'launch-vllm.health_timeout is "soon", expected a number'),
    ("shared: {target_layer_ids: 5}\nlaunch-vllm: {}", "shared.target_layer_ids is 5, expected a list of integers"),
    ("launch-vllm: {target_layer_ids: [1, true]}", "launch-vllm.target_layer_ids is [1, true], expected a list"),
    ("launch-vllm: {trust_remote_code: 'yes'}", 'launch-vllm.trust_remote_code is "yes", expected true or false'),
    ("launch-vllm: {sink: {mooncake: {protocol: 5}}}",
     "launch-vllm.sink.mooncake.protocol is 5, expected one of ['tcp', 'rdma']"),
])
def test_launch_vllm_refuses_deployment_values_of_the_wrong_type(model, tmp_path, capsys, text, error):
    f = tmp_path / "d.yaml"
    f.write_text("shared: {target_layer_ids: [1]}\n" * ("target_layer_ids" not in text) + text + "\n")
    assert f"error: config file {f}: {error}" in one_line(capsys, [str(model), "--config", str(f), "--print-only"])


def test_a_string_for_a_number_is_read_as_its_flag_reads_it(model, tmp_path):
    """YAML 1.1 reads `1e3` as a string; a flag's word is a string too: both are the number."""
    f = tmp_path / "d.yaml"
    f.write_text("launch-vllm:\n  target_layer_ids: [1, 3]\n  health_timeout: 1e3\n  port: '8001'\n"
                 "  sink: {mooncake: {local_buffer_gib: 2}}\n  vllm_args: [--enforce-eager]\n")
    cfg, flags = launch.parse_args([str(model), "--config", str(f)], SECTIONS)
    assert (cfg.health_timeout, cfg.port, cfg.sink.mooncake.local_buffer_gib) == (1000.0, 8001, 2.0)
    assert type(cfg.port) is int and type(cfg.sink.mooncake.local_buffer_gib) is float
    assert flags == ["--enforce-eager"]


def _int_and_float_settings():
    for name, cls in SECTIONS.items():
        for leaf in leaves(cls):
            if base_type(leaf.hint) in (int, float):
                yield name, cls, leaf


@pytest.mark.parametrize("name, cls, leaf", list(_int_and_float_settings()),
                         ids=[f"{n} {'.'.join(leaf.path)}" for n, _, leaf in _int_and_float_settings()])
def test_no_number_setting_of_any_section_takes_a_bool(tmp_path, name, cls, leaf):
    """To Python a bool is an int: `lr: true` was lr 1.0."""
    f = tmp_path / "d.json"
    f.write_text(json.dumps({name: nest({"__".join(leaf.path): True})}))
    with pytest.raises(InputError, match=rf"^config file {f}: {name}\.{'.'.join(leaf.path)} is true, expected "):
        load_config_file(f, cls, name, SECTIONS)


def test_train_lr_true_from_a_deployment_file_is_one_line(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("train:\n  lr: true\n")
    proc = run_cli("train", "--config", f, *TRAIN, "--target-layer-ids", "1", "--print-config", check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"error: config file {f}: train.lr is true, expected a number (fix: write a number, " \
                          "e.g. `lr: 0.001` (its default))\n"


@pytest.mark.parametrize("text, error", [
    ("train: {epochs: 2}\ntrain: {epochs: 3}\n", "sets 'train' twice (lines 1 and 2)"),
    ("train:\n  lr: 0.1\n  epochs: 2\n  lr: 0.2\n", "sets 'lr' twice (lines 2 and 4)"),
    ("train:\n  live:\n    mooncake: {master: 'a:1', master: 'b:1'}\n", "sets 'master' twice (lines 3 and 3)"),
    ("train: {max-steps: 2, max_steps: 3}\n", "sets 'train.max_steps' twice (as 'max-steps' and 'max_steps')"),
    ('{"train": {"epochs": 2}, "train": {"lr": 0.1}}', "sets 'train' twice in one object"),
    ('{"train": {"epochs": 2, "epochs": 3}}', "sets 'epochs' twice in one object"),
])
def test_a_key_given_twice_is_refused_not_last_wins(tmp_path, text, error):
    f = tmp_path / ("d.json" if text.startswith("{") else "d.yaml")
    f.write_text(text)
    with pytest.raises(InputError, match=r"keep one of them") as e:
        load_config_file(f, TrainConfig, "train", SECTIONS)
    assert str(e.value).startswith(f"config file {f} {error}"), e.value


def test_a_key_given_twice_is_one_line_from_the_cli(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("epochs: 2\nepochs: 3\n")
    proc = run_cli("train", "--config", f, *TRAIN, "--target-layer-ids", "1", "--print-config", check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"error: config file {f} sets 'epochs' twice (lines 1 and 2) (fix: keep one of them)\n"


@pytest.mark.parametrize("epochs, error", [
    (str(10 ** 29), f"--epochs {10 ** 29} must be <= {MAX_EPOCHS} (fix: pass a value <= {MAX_EPOCHS} (default 1))"),
    ("1e29", "--epochs '1e29' is not an integer (fix: pass an integer (default 1))"),  # was click's usage block
])
def test_epochs_are_bounded_before_the_run_plans_them(epochs, error):
    """`--epochs 1e29 --max-steps 2` planned 1e29 epochs of batches: a MemoryError."""
    proc = run_cli("train", *TRAIN, "--target-layer-ids", "1", "--epochs", epochs, "--max-steps", "2",
                   "--print-config", check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"error: {error}\n"


def test_a_float_for_an_int_setting_is_refused_as_its_flag_refuses_it(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("train: {epochs: 1.0e+29}\n")  # was int(1e29) epochs
    with pytest.raises(InputError, match=rf"^config file {f}: train.epochs is 1e\+29, expected an integer"):
        load_config_file(f, TrainConfig, "train", SECTIONS)


LAYERED = {TrainConfig: {"data_path": "p", "verifier_name_or_path": "v", "save_path": "s"},
           ExtractConfig: {"model": "m", "data": "p"}, ServeConfig: {"model": "m"}, LaunchConfig: {"model": "m"}}


@pytest.mark.parametrize("cls", LAYERED, ids=lambda c: c.__name__)
def test_every_command_with_target_layer_ids_refuses_a_layer_listed_twice(cls):
    """speculators refuses duplicates (deep in model building, as a ValueError); the order is free."""
    with pytest.raises(InputError, match=r"^--target-layer-ids 3 3 1 lists 3 more than once \(fix: list each "
                                         r"layer once \(in any order"):
        checked(cls, {**LAYERED[cls], "target_layer_ids": [3, 3, 1]})
    assert checked(cls, {**LAYERED[cls], "target_layer_ids": [3, 1]}).target_layer_ids == [3, 1]


def test_train_target_layer_ids_listed_twice_is_one_line():
    proc = run_cli("train", *TRAIN, "--target-layer-ids", "3", "3", "1", "--print-config", check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: --target-layer-ids 3 3 1 lists 3 more than once")
    assert proc.stderr.count("\n") == 1
