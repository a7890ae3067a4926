"""Every command's options come from typed settings, and the connector stands without the CLI."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import MISSING
from pathlib import Path

import click
import pytest

from dspark.cli import main
from dspark.train.config import RESULT_NEUTRAL, TrainConfig

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
# Parameters that are no setting, by design: the help and version flags, `--config FILE` (it fills the settings),
# and the words handed to vLLM verbatim (launch-vllm's whole command line, serve-draft's after `--`).
NOT_SETTINGS = {"help", "version", "config_file", "argv", "vllm_args"}


def _commands(group: click.Group, prefix: str = ""):
    for name, cmd in sorted(group.commands.items()):
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}", cmd


COMMANDS = dict(_commands(main))


def test_the_walk_finds_every_command():
    assert {"prepare", "extract", "train", "eval", "export", "serve", "store repair", "verifier import",
            "bench", "serve-draft", "compare", "regenerate", "replay"} <= set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_is_a_typed_setting_with_its_default(name):
    seen: dict[str, str] = {}
    for param in COMMANDS[name].params:
        if param.name in NOT_SETTINGS:
            continue
        leaf = getattr(param, "setting", None)
        assert leaf is not None, f"dspark {name}: {param.opts} is written by hand, not made from a setting"
        expected = None if leaf.default is MISSING else leaf.default
        assert param.default == expected or (param.multiple and list(param.default or ()) == list(expected)), \
            f"dspark {name} {param.opts[0] if param.opts else param.name}: default {param.default!r} is not its " \
            f"setting's {expected!r}"
        assert param.required == (leaf.default is MISSING), (name, param.opts)
        for flag in [*param.opts, *param.secondary_opts]:
            assert flag not in seen, f"dspark {name}: {flag} is defined by {seen[flag]} and {param.name}"
            seen[flag] = param.name


def test_result_neutral_is_where_the_setting_is():
    assert RESULT_NEUTRAL == {"num_workers", "prefetch_factor", "max_steps", "save_path", "device", "source",
                              "live", "on_damaged", "keep_in_memory_gib", "tracking"}
    a = TrainConfig(data_path="d", verifier_name_or_path="v", save_path="s", target_layer_ids=[1])
    b = TrainConfig(data_path="d", verifier_name_or_path="v", save_path="other", target_layer_ids=[1],
                    num_workers=7, lr=0.5)
    assert a.differences(b) == ["lr"]


BLOCK_CLICK = "import sys; sys.modules['click'] = None\n"


def test_the_connector_and_settings_import_without_click_or_the_cli():
    code = BLOCK_CLICK + (
        "import dspark.core.settings, dspark.connector.config, dspark.connector.base, dspark.connector.zarr.writer\n"
        "import dspark.connector.mooncake.sink, dspark.connector.live, dspark.connector.producer\n"
        "from dspark.connector.registry import SINKS, SOURCES\n"
        "assert sorted(SINKS) == ['mooncake', 'zarr'] and sorted(SOURCES) == ['mooncake', 'zarr']\n"
        "assert not any(m.startswith('dspark.cli') for m in sys.modules), sorted(sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)  # a child: a fresh interpreter's imports


@pytest.mark.skipif(not VLLM_PY.exists(), reason="needs .venv-vllm (scripts/setup.sh --vllm)")
@pytest.mark.slow
def test_the_vllm_connector_loads_without_click():
    """What a vLLM worker imports when it loads our connector by module path."""
    code = BLOCK_CLICK + "import dspark.connector.vllm\nassert 'dspark.cli' not in sys.modules\n"
    subprocess.run([str(VLLM_PY), "-c", code], check=True, cwd=ROOT, capture_output=True)  # vLLM's interpreter


def test_reading_a_setting_loads_no_backend():
    """The registries import their backends at the first lookup, so reading configs stays light."""
    code = ("import sys, dspark.cli\nassert 'torch' not in sys.modules, 'dspark --help must not load torch'\n"
            "import dspark.connector.base\n"
            "assert 'dspark.connector.zarr.reader' not in sys.modules and 'zarr' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)  # a child: a fresh interpreter's imports


def test_the_vllm_launchers_flags_are_launchconfigs_settings(tmp_path):
    """launch-vllm parses with argparse (it runs where click may be missing), from the same settings."""
    import argparse

    from dspark.extract.config import LaunchConfig
    from dspark.extract.launch import parse_args
    from dspark.core.settings import add_arguments, cli_leaves

    parser = argparse.ArgumentParser()
    add_arguments(parser, LaunchConfig)
    flags = {f for action in parser._actions for f in action.option_strings} - {"-h", "--help", "--config"}
    assert flags == {f for leaf in cli_leaves(LaunchConfig) if not leaf.meta["positional"] for f in leaf.flags}
    config = tmp_path / "launch.yaml"
    config.write_text("model: org/m\ntarget_layer_ids: [1, 2]\nsink:\n  mooncake:\n    master: 10.0.0.1:50051\n")
    cfg, vllm_flags = parse_args(["--config", str(config), "--target-layer-ids", "3", "--", "--port", "9000"])
    assert (cfg.model, cfg.target_layer_ids, cfg.sink.mooncake.master) == ("org/m", [3], "10.0.0.1:50051")
    assert (cfg.sink.to, cfg.health_timeout, vllm_flags) == ("mooncake", 1800.0, ["--port", "9000"])
