"""`dspark serve-draft`: the speculative config a checkpoint's layout needs, and its refusals (fast: nothing
started; the served run itself is in test_vllm_dflash.py)."""

import json
import os
import socket
from pathlib import Path

import pytest

from conftest import run_cli
from dspark.settings import build
from dspark.decode.config import PromptLookupConfig
from dspark.errors import InputError
from dspark.export.folder import export
from dspark.serve_draft import ServeDraftConfig, choose, plan


def drafter(tmp_path: Path, sample_from_anchor: bool, tokens: int) -> str:
    """A drafter folder with the config keys serve-draft reads (what `dspark export` writes)."""
    folder = tmp_path / f"drafter-{sample_from_anchor}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "sample_from_anchor": sample_from_anchor, "block_size": 8,
        "speculators_config": {"proposal_methods": [{"speculative_tokens": tokens}],
                               "verifier": {"name_or_path": "Org/Verifier"}}}))
    return str(folder)


def test_the_layout_picks_the_method(tmp_path):
    no_anchor, anchor = drafter(tmp_path, False, 7), drafter(tmp_path, True, 8)
    # DFlash's layout is what V1 `method: dflash` serves, on any machine, with the drafter's own count
    assert choose(ServeDraftConfig("v", no_anchor), gpu=False) == ("dflash", 7, None)
    assert choose(ServeDraftConfig("v", no_anchor), gpu=True) == ("dflash", 7, None)
    # DSpark's layout: method dspark on a GPU; without one, dflash and a loud warning
    assert choose(ServeDraftConfig("v", anchor), gpu=True) == ("dspark", 8, None)
    method, tokens, warning = choose(ServeDraftConfig("v", anchor), gpu=False)
    assert (method, tokens) == ("dflash", 8) and "shifted by one" in warning
    assert choose(ServeDraftConfig("v", anchor, method="dflash", num_speculative_tokens=3), gpu=True)[:2] == ("dflash", 3)
    with pytest.raises(InputError, match="needs a GPU"):
        choose(ServeDraftConfig("v", anchor, method="dspark"), gpu=False)


def test_plan_baselines_and_the_v2_runner(tmp_path):
    ngram = plan(ServeDraftConfig("v", method="ngram", lookup=PromptLookupConfig(prompt_lookup_max=3)), ["--enforce-eager"], None, gpu=False)
    assert ngram["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                           "prompt_lookup_max": 3}
    assert ngram["command"][-1] == "--enforce-eager" and ngram["health"] == "http://127.0.0.1:8000"
    none = plan(ServeDraftConfig("v", method="none", port=9001), [], None, gpu=False)
    assert none["speculative_config"] is None and "--speculative-config" not in none["command"]
    assert none["command"][none["command"].index("--port") + 1] == "9001"
    v2 = plan(ServeDraftConfig("v", drafter(tmp_path, True, 8)), [], "/copy", gpu=True)
    assert v2["env"]["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert v2["speculative_config"] == {"model": "/copy", "method": "dspark", "num_speculative_tokens": 8,
                                        "draft_sample_method": "probabilistic", "rejection_sample_method": "block"}


@pytest.mark.parametrize("kw, message", [
    (dict(method="ngram", drafter="d"), "--method ngram takes no --drafter"),
    (dict(), "--method auto needs --drafter"),
    (dict(method="ngram", lookup=dict(prompt_lookup_min=4, prompt_lookup_max=2)), "--prompt-lookup-min 4 is above"),
])
def test_settings_that_cannot_serve_are_refused(kw, message):
    with pytest.raises(InputError, match=message):
        build(ServeDraftConfig, {"verifier": "v", **kw})


def test_flags_after_the_separator_that_serve_draft_owns_are_refused():
    with pytest.raises(InputError, match="--port after `--` conflicts"):
        plan(ServeDraftConfig("v", method="none"), ["--port=9"], None, gpu=False)


def test_print_only_on_a_real_export(reference_run, verifier, tmp_path):
    """The CLI on a trained checkpoint's export: a temporary copy naming the local verifier is not made for
    --print-only, and the default DSpark checkpoint on this CPU is served as dflash with the warning."""
    export(os.path.join(reference_run[0].save_path, "latest"), str(tmp_path / "export"), "dspark/tiny-verifier")
    out = run_cli("serve-draft", "--verifier", verifier, "--drafter", tmp_path / "export", "--print-only",
                  "--", "--enforce-eager")
    p = json.loads(out.stdout)
    assert p["method"] == "dflash" and p["speculative_config"]["num_speculative_tokens"] == 8
    assert p["speculative_config"]["model"] == str(tmp_path / "export") and "shifted by one" in p["warning"]
    bad = run_cli("serve-draft", "--verifier", verifier, "--drafter", tmp_path, check=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"error: --drafter {tmp_path} has no config.json (fix: pass a `dspark export` folder or RUN/latest)"]


def test_a_port_in_use_is_refused_before_vllm_starts(verifier):
    """Another server's /health on the port would answer for ours, and report it ready while it fails to bind."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        out = run_cli("serve-draft", "--verifier", verifier, "--method", "none", "--port", port, check=False)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"error: port {port} on 127.0.0.1 is in use (Address already in use) (fix: stop what listens there, or "
        "pass another --port)"]
