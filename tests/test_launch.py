"""The vLLM launcher: the seed's command line in, the exact vLLM argv out; health wait and no orphans.

vLLM itself never runs here: a tiny http.server script stands in for the server process.
"""

import contextlib
import io
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from conftest import Ran, hf_cache_model, run_cli, run_process, wait_for
from dspark import vllm_server
from dspark.connector.config import SinkConfig
from dspark.deployment import SECTIONS
from dspark.core.errors import InputError
from dspark.extract import launch
from dspark.core.net import free_port

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["24", "48", "72", "88", "92"]
VLLM_FLAGS = ["--tensor-parallel-size", "8", "--max-model-len", "8192", "--served-model-name", "kimi"]
SEED = ["--mooncake-master", "10.0.0.5:50051", "--mooncake-metadata-server", "P2PHANDSHAKE",
        "--mooncake-protocol", "tcp", "--mooncake-global-segment-gib", "32", "--mooncake-local-buffer-gib", "4",
        "--mooncake-writer-threads", "4", "--target-layer-ids", *LAYERS, "--trust-remote-code"]


@pytest.fixture
def model(tmp_path) -> Path:
    """All the launcher reads of a verifier: its config.json (multimodal style, to cover text_config)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(
        json.dumps({"text_config": {"num_hidden_layers": 94, "hidden_size": 128}}))
    return tmp_path / "model"


def _launch(entry: list[str], *args, env: dict | None = None, why: str | None = None) -> Ran:
    """The launcher's plan (`--print-only` starts nothing), on a box without a GPU, through either entry point:
    in this process, or with `why` in a child (an environment read where a process starts)."""
    env = {"CUDA_VISIBLE_DEVICES": "", "VLLM_CPU_KVCACHE_SPACE": None, **(env or {})}
    if why:
        child = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
        if entry == ["scripts/launch_vllm.py"]:
            assert why.strip()
            proc = subprocess.run([sys.executable, *entry, *map(str, args)], capture_output=True, text=True,
                                  env=child, cwd=ROOT)
            return Ran(proc.args, proc.returncode, proc.stdout, proc.stderr)
        proc = run_process(*entry[2:], *args, why=why, check=False, env=child, cwd=ROOT)
        return Ran(proc.args, proc.returncode, proc.stdout, proc.stderr)
    if entry != ["scripts/launch_vllm.py"]:
        return run_cli(*entry[2:], *args, check=False, env=env, cwd=ROOT)
    out, err, code = io.StringIO(), io.StringIO(), 0
    argv = [str(ROOT / entry[0]), *map(str, args)]
    with mock.patch.dict(os.environ), mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        for key, value in env.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        try:
            runpy.run_path(str(ROOT / entry[0]), run_name="__main__")  # the script as `python SCRIPT` runs it
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return Ran([*entry, *map(str, args)], code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("entry, backend", [(["scripts/launch_vllm.py"], "mooncake"),
                                            (["-m", "dspark.cli", "launch-vllm"], "zarr,mooncake")])
def test_seed_command_line(model, tmp_path, entry, backend):
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "prepare.json").write_text(json.dumps({"fingerprint": "abc123"}))
    zarr = ["--store", tmp_path / "store", "--data", tmp_path / "prepared"] if "zarr" in backend else []
    proc = _launch(entry, model, "--hidden-states-backend", backend, *SEED, *zarr, "--print-only", "--",
                   *VLLM_FLAGS)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)

    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [24, 48, 72, 88, 92, 94]}}}
    assert plan["speculative_config"] == spec
    kv = plan["kv_transfer_config"]
    assert {k: kv[k] for k in ("kv_connector", "kv_connector_module_path", "kv_role")} == {
        "kv_connector": "DsparkHiddenStatesConnector", "kv_connector_module_path": "dspark.connector.vllm",
        "kv_role": "kv_producer"}
    extra = kv["kv_connector_extra_config"]
    seed_mooncake = {"master": "10.0.0.5:50051", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                     "global_segment_gib": 32.0, "local_buffer_gib": 4.0, "writer_threads": 4,
                     "local_hostname": "127.0.0.1"}
    assert {k: extra["mooncake"][k] for k in seed_mooncake} == seed_mooncake
    assert (extra["to"], SinkConfig.from_extra_config(extra).writer_threads) == (backend, 4)
    if zarr:
        assert (extra["zarr"]["store"], extra["prepared_fingerprint"]) == (str(tmp_path / "store"), "abc123")

    cmd = plan["command"]  # no --host/--port given: vLLM's defaults (every interface, 8000)
    assert cmd[:6] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                       "--trust-remote-code"]
    assert plan["health"] == "http://127.0.0.1:8000"
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == spec
    assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1]) == kv
    assert cmd[-len(VLLM_FLAGS):] == VLLM_FLAGS
    assert plan["env"] == {"VLLM_CPU_KVCACHE_SPACE": "1"}


def test_headless_follower_runs_vllm_serve_with_the_heads_configs(model):
    """The seed's pair: rank 1 gets the same configs, through `vllm serve --headless` (the api_server ignores it)."""
    pair = ["--tensor-parallel-size", "8", "--nnodes", "2", "--master-addr", "10.0.0.4"]
    head = json.loads(_launch(["scripts/launch_vllm.py"], model, *SEED, "--print-only", "--", *pair,
                              "--node-rank", "0").stdout)
    follower = json.loads(_launch(["scripts/launch_vllm.py"], model, *SEED, "--print-only", "--", *pair,
                                  "--node-rank", "1", "--headless").stdout)
    assert follower["command"][:5] == [sys.executable, "-m", "dspark.extract.vllm_cli", "serve", str(model)]
    assert head["command"][2] == "vllm.entrypoints.openai.api_server"
    assert follower["command"][-3:] == ["--node-rank", "1", "--headless"]
    assert follower["health"] is None and head["health"].startswith("http://")
    for key in ("speculative_config", "kv_transfer_config", "env"):
        assert follower[key] == head[key]


@pytest.mark.parametrize("args, message", [
    (["--target-layer-ids", "24", "95"], "out of range"),
    (["--target-layer-ids", "1,3,94"], "duplicate layer ids"),  # 94 (the last layer) is always added
    (["--target-layer-ids", "1", "--hidden-states-backend", "zarr"], "needs --store and --data"),
    (["--target-layer-ids", "1", "--", "--speculative-config", "{}"], "--speculative-config after `--`"),
    (["--target-layer-ids", "1", "--", "--model", "x"], "--model after `--`"),
    (["--target-layer-ids", "1", "--port", "9000", "--", "--port", "9001"],
     "--port 9000 before `--` and --port 9001 after it disagree"),
    (["--target-layer-ids", "1", "--", "--port", "http"], "--port 'http' after `--` is not a port number"),
    (["--target-layer-ids", "1", "--mooncake-protocol", "udp"], "invalid choice"),
])
def test_bad_input_is_one_line(model, capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        launch.main([str(model), *args, "--print-only"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("before, after, command, health", [
    ([], [], [], "http://127.0.0.1:8000"),  # vLLM's defaults: every interface, port 8000
    ([], ["--port", "9123", "--host", "0.0.0.0"], [], "http://127.0.0.1:9123"),  # the card's way: vLLM's flags
    ([], ["--port=9124", "--host=::"], [], "http://[::1]:9124"),
    (["--host", "10.1.2.3", "--port", "9000"], [], ["--host", "10.1.2.3", "--port", "9000"], "http://10.1.2.3:9000"),
    (["--port", "9000"], ["--port", "9000"], [], "http://127.0.0.1:9000"),  # the same value twice agrees
])
def test_host_and_port_after_dashdash_are_vllms_and_the_health_wait_follows_them(model, before, after, command,
                                                                                  health):
    args, flags = launch.parse_args([str(model), "--target-layer-ids", "1", *before, "--", *after])
    plan = launch.build_plan(args, flags)
    cmd = plan["command"]  # [python, -m, server, --model, MODEL, <what the launcher adds>, configs, <after>]
    assert cmd[5:cmd.index("--speculative-config")] == command and cmd[len(cmd) - len(after):] == after
    assert sum(w.split("=")[0] == "--port" for w in cmd) == (1 if before or after else 0)
    assert plan["health"] == health


def test_a_deployment_file_gives_its_settings_and_vllm_flags_and_the_command_line_wins(model, tmp_path):
    """configs/*.yaml: the launcher's section over the shared settings; its vllm_args go before the flags
    after `--`, so a flag given on the command line is the one vLLM keeps (its parser takes the last)."""
    f = tmp_path / "deploy.yaml"
    f.write_text("shared:\n  target_layer_ids: [1, 3]\n  mooncake: {writer_threads: 3}\n"
                 "launch-vllm:\n  vllm_args: [--enforce-eager, --max-model-len, '512']\n"
                 "  sink: {mooncake: {global_segment_gib: 0}}\n")
    args, flags = launch.parse_args([str(model), "--config", str(f), "--mooncake-writer-threads", "5",
                                     "--", "--max-model-len", "256"], SECTIONS)
    assert args.target_layer_ids == [1, 3]
    assert (args.sink.mooncake.writer_threads, args.sink.mooncake.global_segment_gib) == (5, 0)
    assert flags == ["--enforce-eager", "--max-model-len", "512", "--max-model-len", "256"]
    assert launch.build_plan(args, flags)["command"][-5:] == flags


@pytest.mark.parametrize("entry", [["scripts/launch_vllm.py"], ["-m", "dspark.cli", "launch-vllm"]])
def test_both_entry_points_read_the_shipped_deployment_file(model, entry):
    """As compose and Slurm start the extractor: `--config configs/cpu.yaml`, its shared and launch-vllm settings."""
    proc = _launch(entry, model, "--config", ROOT / "configs" / "cpu.yaml", "--print-only")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["speculative_config"]["draft_model_config"]["hf_config"] == {
        "eagle_aux_hidden_state_layer_ids": [1, 3, 5, 94]}
    assert plan["command"][-3:] == ["--enforce-eager", "--max-model-len", "1024"]


HF_HOME_AT_START = "HF_HOME is read where a process starts (huggingface_hub's constants), as vLLM's shell sets it"


@pytest.mark.slow
def test_a_hub_id_is_read_from_the_hugging_face_cache_as_vllm_finds_it(tmp_path):
    """Not a folder: its config.json comes from HF_HOME's cache, or vLLM's --download-dir; only when
    neither holds it is --num-hidden-layers asked for, in one line."""
    env = {"HF_HOME": str(tmp_path / "hf")}
    proc = _launch(["-m", "dspark.cli", "launch-vllm"], "Org/Model", "--target-layer-ids", "1", "--print-only",
                   env=env, why=HF_HOME_AT_START)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: Org/Model is neither a local folder nor a model in the Hugging Face "
                                  f"cache at {tmp_path / 'hf' / 'hub'}, so its layer count is unknown")
    assert "--num-hidden-layers" in proc.stderr
    ok = _launch(["scripts/launch_vllm.py"], "Org/Model", "--target-layer-ids", "1,3", "--num-hidden-layers", "6",
                 "--print-only", env=env, why=HF_HOME_AT_START)
    assert json.loads(ok.stdout)["speculative_config"]["draft_model_config"]["hf_config"] == {
        "eagle_aux_hidden_state_layer_ids": [1, 3, 6]}

    hf_cache_model(tmp_path / "hf", "Org/Model", config={"num_hidden_layers": 12})
    hf_cache_model(tmp_path / "downloads" / "x", "Org/Model", config={"num_hidden_layers": 7})
    for extra, last in (([], 12), (["--", "--download-dir", tmp_path / "downloads" / "x" / "hub"], 7)):
        proc = _launch(["scripts/launch_vllm.py"], "Org/Model", "--target-layer-ids", "1,3", "--print-only", *extra,
                       env=env, why=HF_HOME_AT_START)
        assert proc.returncode == 0, proc.stderr
        layers = json.loads(proc.stdout)["speculative_config"]["draft_model_config"]["hf_config"]
        assert layers == {"eagle_aux_hidden_state_layer_ids": [1, 3, last]}
        assert json.loads(proc.stdout)["command"][4] == "Org/Model"  # vLLM gets the hub id, as typed


FAKE_SERVER = r"""
import http.server, subprocess, sys, time
port, delay, mode, pids = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # like vLLM's engine core
open(pids, "w").write(f"{worker.pid}\n")
time.sleep(delay)
if mode.startswith("exit"):
    sys.exit(int(mode[4:]))
if mode == "hang":
    time.sleep(60)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", port), Health)
if mode == "once":  # answer the health check, then exit: the launcher must return this status
    server.handle_request()
    sys.exit(7)
server.serve_forever()
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    port, pids = free_port("127.0.0.1"), tmp_path / "pids"

    def command(delay: float, mode: str) -> list[str]:
        return [sys.executable, str(script), str(port), str(delay), mode, str(pids)]

    def worker() -> int:  # the fake's own child: it must not outlive the launcher either
        wait_for(lambda: pids.exists() and pids.read_text().endswith("\n"), 10, "the fake server's worker")
        return int(pids.read_text())

    return command, vllm_server.health_url("127.0.0.1", port), worker


def test_ready_then_child_status(fake, capsys):
    command, url, worker = fake
    assert vllm_server.run_server(command(0.5, "once"), {}, url, timeout=10) == 7
    assert capsys.readouterr().err == f"vLLM extractor ready on {url}/v1\n"
    wait_for(lambda: not _alive(worker()), 5, "the worker to be stopped")


def test_child_exit_before_ready(fake, capsys):
    command, url, worker = fake
    with pytest.raises(vllm_server.ServerExited) as err:
        vllm_server.run_server(command(0.2, "exit3"), {}, url, timeout=10)
    assert err.value.exit_code == 3 and "ready" not in capsys.readouterr().err
    wait_for(lambda: not _alive(worker()), 5, "the worker to be stopped")


def test_timeout_kills_the_group(fake):
    command, url, worker = fake
    with pytest.raises(vllm_server.LaunchError, match="not healthy"):
        vllm_server.run_server(command(0, "hang"), {}, url, timeout=1)
    wait_for(lambda: not _alive(worker()), 5, "the worker to be stopped")


def test_a_port_in_use_is_refused_before_the_server_starts(fake, tmp_path):
    """Whatever listens on the port would answer /health for our server, which then fails to bind."""
    command, url, _ = fake
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as other:
        other.bind((host, int(port)))
        other.listen()
        with pytest.raises(InputError, match=f"port {port} on {host} is in use"):
            vllm_server.run_server(command(0, "serve"), {}, url, timeout=10)
    assert not (tmp_path / "pids").exists()  # never started


def test_kill_of_launcher_stops_server(fake):
    command, url, worker = fake
    code = ("import sys; from dspark import vllm_server; "
            f"sys.exit(vllm_server.run_server({command(0, 'serve')!r}, {{}}, {url!r}, 10))")
    launcher = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    assert launcher.stderr.readline() == f"vLLM extractor ready on {url}/v1\n"
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(10) == 128 + signal.SIGTERM  # the server died of the forwarded SIGTERM
    wait_for(lambda: not _alive(worker()), 5, "the worker to be stopped")


def test_headless_follower_is_not_waited_for(fake, capsys):
    """A follower serves no /health: the launcher just runs it, and returns its status."""
    command, _, worker = fake
    assert vllm_server.run_server(command(0.2, "exit0"), {}, None, timeout=1) == 0
    assert capsys.readouterr().err == "vLLM headless follower started; it serves its head's requests\n"
    wait_for(lambda: not _alive(worker()), 5, "the worker to be stopped")
