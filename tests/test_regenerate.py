"""`dspark regenerate`: the verifier's own replies, written once per prompt in input order, whatever is killed when."""

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import run_cli, wait_for, write_jsonl
from dspark.core.errors import InputError
from dspark.data.regenerate import RegenerateConfig, regenerate

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
# float32: the two engines' greedy choices are then compared, not two roundings of bf16 logits.
SMALL = ["--max-prompts", "12", "--max-new-tokens", "24", "--batch-size", "4", "--dtype", "float32", "--no-progress"]
# Enough small batches that a run is still going when the test kills it.
KILLED = ["--max-prompts", "40", "--max-new-tokens", "24", "--batch-size", "2", "--dtype", "float32", "--no-progress"]


def cli(python, *args, **kw) -> subprocess.Popen:
    return subprocess.Popen([str(python), "-m", "dspark.cli", "regenerate", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True, **kw)


def summary_of(proc) -> dict:
    """The summary a finished `dspark regenerate` printed: a child process's (cli), or run_cli's in this process."""
    out, err = proc.communicate(timeout=600) if isinstance(proc, subprocess.Popen) else (proc.stdout, proc.stderr)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out[out.rindex("\n{\n") + 1 if "\n{\n" in out else out.index("{"):])  # after any log lines


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def committed(output: Path) -> int:
    record = output.with_name(output.name + ".regenerate.json")
    return json.loads(record.read_text())["done"] if record.exists() else 0  # replaced atomically: never torn


def greedy_reference(verifier: Path, prompts: list[list[dict]], max_new_tokens: int) -> list[str]:
    """The verifier's own `generate`, one prompt at a time (no padding), with its own generation_config."""
    import torch
    from transformers import AutoModelForCausalLM

    from dspark.data.prompts import render_prompt
    from dspark.data.prepare import load_tokenizer

    tok = load_tokenizer(verifier)
    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
    replies = []
    for turns in prompts:
        ids = torch.tensor([render_prompt(tok, turns)])
        new = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
        if tok.eos_token_id in new:
            new = new[: new.index(tok.eos_token_id)]
        replies.append(tok.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False))
    return replies


def kill_mid_run(python, args: list, output: Path, tear: bool) -> int:
    """Start a run, SIGKILL it after its first committed batches (optionally tearing a line): what it committed."""
    proc = cli(python, *args, "--output", output)

    def some_committed():
        assert proc.poll() is None, f"the run ended before it was killed: {proc.stderr.read()[-2000:]}"
        return committed(output) >= 4

    wait_for(some_committed, 300, "the first committed batches")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = committed(output)
    if tear:  # a write the kill cut short: half a line at the end
        with open(output, "ab") as f:
            f.write(b'{"messages": [{"role": "user", "content": "half a li')
    return done


# Several `dspark regenerate --engine vllm` runs on one vLLM engine: the CLI called once per argv (a JSON list of
# argument lists) in this process, the engine the first run opens kept open for the next ones (a run otherwise
# loads and closes its own; the runs share the model and every setting the engine is built from). Prints each
# run's summary, in order, as one JSON list on the last line.
RUNS_ON_ONE_ENGINE = r"""
import contextlib, io, json, sys
from dspark.cli import main
from dspark.data import regenerate as module

opened = []


class Kept(module.Generator):
    def __init__(self, cfg, tokenizer, stop, dtype):
        if not opened:
            opened.append((module.VllmGenerator(cfg, tokenizer, stop, dtype), cfg, dtype))
        else:  # each run starts as on a fresh engine: nothing cached from the run before
            assert opened[0][0].llm.reset_prefix_cache()
        self.engine, first, first_dtype = opened[0]
        same = ("model", "seed", "temperature", "max_new_tokens", "trust_remote_code")
        assert dtype == first_dtype and all(getattr(cfg, k) == getattr(first, k) for k in same), "another engine"
        self.engine.cfg, self.engine.tokenizer, self.engine.stop = cfg, tokenizer, stop

    def generate(self, prompts, seed):
        return self.engine.generate(prompts, seed)

    def close(self):
        pass  # kept for the next run; closed at the end


module.GENERATORS.entries["vllm"] = Kept
summaries = []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["regenerate", *argv], standalone_mode=False)
    text = out.getvalue()
    summaries.append(json.loads(text[text.rindex("\n{\n") + 1 if "\n{\n" in text else text.index("{"):]))
opened[0][0].close()
print(json.dumps(summaries))
"""


def runs_on_one_engine(*argvs: list) -> list[dict]:
    proc = subprocess.run([str(VLLM_PY), "-c", RUNS_ON_ONE_ENGINE, json.dumps([[str(a) for a in argv]
                                                                                for argv in argvs])],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_replies_are_the_verifiers_own_greedy_generations_and_prepare_reads_them(tmp_path, verifier, chat_file):
    from dspark.data.prepare import PrepareConfig, prepare

    out = tmp_path / "regen.jsonl"
    summary = json.loads(run_cli("regenerate", "--model", verifier, "--data", chat_file, "--output", out,
                                 *SMALL).stdout)
    written = lines(out)
    source = [json.loads(line)["messages"] for line in chat_file.read_text().splitlines()]
    assert summary["prompts"] == 12 and summary["written"] == len(written) == 12 - summary["dropped"]
    assert summary["generated_tokens"] > 0 and summary["tokens_per_s"] > 0 and not summary["up_to_date"]
    assert json.loads(out.with_name(out.name + ".summary.json").read_text()) == summary
    # Each line: the original prompt turns in input order, then the verifier's reply.
    assert [r["source"]["index"] for r in written] == sorted(r["source"]["index"] for r in written)
    for r in written:
        original = source[r["source"]["index"]]
        first_reply = next(i for i, m in enumerate(original) if m["role"] == "assistant")
        assert r["source"]["where"] == f"chat.jsonl:{r['source']['index'] + 1}"
        assert r["messages"][:-1] == original[:first_reply] and r["messages"][-1]["role"] == "assistant"
    # The replies are what the verifier itself says, batched and left-padded or not.
    expected = greedy_reference(verifier, [r["messages"][:-1] for r in written], 24)
    assert [r["messages"][-1]["content"] for r in written] == expected
    assert any(r["messages"][-1]["content"] != source[r["source"]["index"]][1]["content"] for r in written)
    stats = prepare(PrepareConfig(model=str(verifier), data=str(out), output=str(tmp_path / "prepared"),
                                  seq_length=256), progress=False)
    assert stats["kept"] == len(written) and stats["dropped"] == 0


def test_later_turns_are_answered_after_the_verifiers_own_replies(tmp_path, verifier, chat_file):
    from dspark.data.prompts import later_turns

    every = tmp_path / "all.jsonl"
    summary = json.loads(run_cli("regenerate", "--model", verifier, "--data", chat_file, "--output", every,
                                 "--turns", "0", *SMALL).stdout)
    written = lines(every)
    source = [json.loads(line)["messages"] for line in chat_file.read_text().splitlines()]
    replies = [[i for i, m in enumerate(r["messages"]) if m["role"] == "assistant"] for r in written]
    assert summary["replies"] == sum(map(len, replies)) > summary["written"] == len(written)
    ended = 0
    for r, at in zip(written, replies):
        original, messages = source[r["source"]["index"]], r["messages"]
        # the questions are the file's, in order, up to the last one answered
        questions = [m for m in original if m["role"] != "assistant"]
        assert [m for m in messages if m["role"] != "assistant"] == questions[: len(messages) - len(at)]
        assert messages[-1]["role"] == "assistant" and at == sorted(at)
        ended += len(at) < 1 + len(later_turns(original))
    assert ended == sum(summary["turns_ended"].values())
    # each reply is the verifier's own greedy reply to the conversation so far, its earlier replies included
    expected = greedy_reference(verifier, [r["messages"][:k] for r, at in zip(written, replies) for k in at], 24)
    assert [r["messages"][k]["content"] for r, at in zip(written, replies) for k in at] == expected
    # --turns 2 stops each conversation after its second reply, the same replies
    two = tmp_path / "two.jsonl"
    run_cli("regenerate", "--model", verifier, "--data", chat_file, "--output", two, "--turns", "2", *SMALL)
    assert [r["messages"] for r in lines(two)] == [r["messages"][: at[1] + 1] if len(at) > 1 else r["messages"]
                                                   for r, at in zip(written, replies)]


@pytest.mark.slow
def test_kill_9_mid_run_then_rerun_matches_the_uninterrupted_run(tmp_path, verifier, chat_file):
    """No vLLM. The killed run is a child process (the kill -9 is the claim); the reference and the reruns
    run in this process."""
    args = ["--model", verifier, "--data", chat_file, *KILLED]
    reference = summary_of(run_cli("regenerate", *args, "--output", tmp_path / "ref.jsonl", check=False))
    done = kill_mid_run(sys.executable, args, tmp_path / "out.jsonl", tear=True)
    resumed = summary_of(run_cli("regenerate", *args, "--output", tmp_path / "out.jsonl", check=False))
    assert 4 <= done < 40 and resumed["resumed_from"] == done
    assert (tmp_path / "out.jsonl").read_bytes() == (tmp_path / "ref.jsonl").read_bytes()
    assert resumed["written"] == reference["written"] and resumed["truncated"] == reference["truncated"]
    again = summary_of(run_cli("regenerate", *args, "--output", tmp_path / "out.jsonl", check=False))
    assert again["up_to_date"] and "nothing to do" in again["note"] and again["generated_tokens"] == 0


def test_a_larger_max_prompts_extends_the_file_as_one_run_would_have_written_it(tmp_path, verifier, chat_file):
    def run(output, n):
        return regenerate(RegenerateConfig(model=str(verifier), data=str(chat_file), output=str(output),
                                           max_new_tokens=8, batch_size=2, max_prompts=n, dtype="float32"),
                          progress=False)

    run(tmp_path / "a.jsonl", 3)
    extended = run(tmp_path / "a.jsonl", 5)
    run(tmp_path / "b.jsonl", 5)
    assert extended["resumed_from"] == 3 and extended["written"] == 5
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    fewer = run(tmp_path / "a.jsonl", 4)
    assert fewer["up_to_date"] and "more than --max-prompts 4" in fewer["note"]


def test_an_output_from_other_settings_or_another_writer_or_not_from_regenerate_is_refused(tmp_path, verifier,
                                                                                          chat_file):
    out = tmp_path / "regen.jsonl"
    base = dict(model=str(verifier), data=str(chat_file), output=str(out), max_new_tokens=4, max_prompts=2,
                dtype="float32")
    regenerate(RegenerateConfig(**base), progress=False)
    before = out.read_bytes()
    with pytest.raises(InputError, match=r"made from another model, data or settings \(max_new_tokens 4 -> 5\)"):
        regenerate(RegenerateConfig(**{**base, "max_new_tokens": 5}), progress=False)
    with pytest.raises(InputError, match=r"another model, data or settings \(temperature 0.0 -> 0.7; seed 0 -> 1\)"):
        regenerate(RegenerateConfig(**{**base, "temperature": 0.7, "seed": 1}), progress=False)
    with pytest.raises(InputError, match=r"another model, data or settings \(turns None -> 2\)"):
        regenerate(RegenerateConfig(**{**base, "turns": 2}), progress=False)
    other = write_jsonl(tmp_path / "other.jsonl", chat_file.read_text().splitlines()[5:])
    with pytest.raises(InputError, match=r"another model, data or settings \(data '"):
        regenerate(RegenerateConfig(**{**base, "data": str(other)}), progress=False)
    assert out.read_bytes() == before
    stranger = tmp_path / "stranger.jsonl"
    stranger.write_text('{"messages": []}\n')
    with pytest.raises(InputError, match="has no stranger.jsonl.regenerate.json beside it"):
        regenerate(RegenerateConfig(**{**base, "output": str(stranger)}), progress=False)
    import fcntl

    with open(out, "ab") as held:  # as a run in progress holds it
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(InputError, match="another `dspark regenerate` is writing"):
            regenerate(RegenerateConfig(**base), progress=False)
    assert out.read_bytes() == before
    proc = run_cli("regenerate", "--model", verifier, "--data", chat_file, "--output", out, "--max-new-tokens", "5",
                   "--max-prompts", "2", "--dtype", "float32", check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


def test_blank_replies_are_dropped_and_cut_replies_kept_and_both_counted_across_reruns(tmp_path, verifier,
                                                                                     monkeypatch):
    from dspark.data import regenerate as module

    class Scripted(module.Generator):
        """Odd prompts get a blank reply, even ones a reply cut at --max-new-tokens."""

        def __init__(self, cfg, tokenizer, stop, dtype):
            pass

        def generate(self, prompts, seed):
            return [module.Generation(" \n", [], True) if (seed + j) % 2 else module.Generation("cut short", [7], False)
                    for j in range(len(prompts))]

    monkeypatch.setitem(module.GENERATORS.entries, "transformers", Scripted)
    chats = write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "user", "content": "What is 16 plus 32?"}, {"role": "assistant", "content": "48"}]},
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "gpt", "value": "ok"}]},
        {"messages": [{"role": "user", "content": "Tell me about the horse."}]},  # questions only: a prompt too
        {"messages": [{"role": "user", "content": "Count from 25 to 28."}, {"role": "assistant", "content": "25"}]},
        {"messages": [{"role": "user", "content": "How do you spell pencil? And horse?"}, {"role": "bot", "content": "p"}]},
    ])
    cfg = RegenerateConfig(model=str(verifier), data=str(chats), output=str(tmp_path / "o.jsonl"), batch_size=3)
    first = regenerate(cfg, progress=False)
    assert (first["prompts"], first["written"], first["truncated"]) == (4, 2, 2)
    assert first["dropped_by_reason"] == {"empty_reply": 2, "no_user_turn": 1} and first["dropped"] == 3
    assert [r["messages"][-1]["content"] for r in lines(tmp_path / "o.jsonl")] == ["cut short", "cut short"]
    again = regenerate(cfg, progress=False)  # the counts of the run that did the work are kept
    assert again["up_to_date"] and {k: again[k] for k in ("written", "truncated", "dropped_by_reason")} == {
        k: first[k] for k in ("written", "truncated", "dropped_by_reason")}
    # Prompts longer than --max-prompt-tokens are skipped and counted; it is a setting of the output's identity.
    from dspark.data.prompts import render_prompt
    from dspark.data.prepare import load_tokenizer

    tok = load_tokenizer(verifier)
    lengths = [len(render_prompt(tok, [{"role": "user", "content": c}])) for c in
               ("What is 16 plus 32?", "Tell me about the horse.", "Count from 25 to 28.",
                "How do you spell pencil? And horse?")]
    limit = min(lengths)
    assert max(lengths) > limit
    short = regenerate(replace(cfg, output=str(tmp_path / "short.jsonl"), max_prompt_tokens=limit), progress=False)
    assert short["prompts"] == sum(n <= limit for n in lengths)
    assert short["dropped_by_reason"][f"longer than --max-prompt-tokens {limit}"] == sum(n > limit for n in lengths)
    with pytest.raises(InputError, match="max_prompt_tokens"):
        regenerate(replace(cfg, max_prompt_tokens=limit), progress=False)


@pytest.fixture(scope="module")
def vllm_runs(verifier, chat_file, tmp_path_factory):
    """The vLLM runs of both vLLM tests over KILLED's prompts: one killed mid-run (its own process, the kill
    is the claim), then one engine for the uninterrupted reference and the rerun that resumes the killed
    output (two `dspark regenerate` runs in one process)."""
    if not VLLM_PY.exists():
        pytest.skip("no .venv-vllm (bash scripts/setup.sh --vllm)")
    tmp = tmp_path_factory.mktemp("vllm")
    args = ["--engine", "vllm", "--model", verifier, "--data", chat_file, *KILLED]
    done = kill_mid_run(VLLM_PY, args, tmp / "out.jsonl", tear=True)
    reference, resumed = runs_on_one_engine([*args, "--output", tmp / "ref.jsonl"],
                                            [*args, "--output", tmp / "out.jsonl"])
    return {"reference": (tmp / "ref.jsonl", reference), "killed": (tmp / "out.jsonl", done, resumed)}


@pytest.mark.slow
def test_vllm_greedy_replies_equal_the_transformers_engines(tmp_path, verifier, chat_file, vllm_runs):
    """Its time is its setup: the vLLM runs it shares with the kill -9 test (a killed run, then one engine)."""
    out, summary = vllm_runs["reference"]
    hf_args = ["--model", verifier, "--data", chat_file, *KILLED, "--output", tmp_path / "hf.jsonl"]
    summary_of(run_cli("regenerate", *hf_args, check=False))  # the transformers engine, in this process
    v, hf = lines(out), lines(tmp_path / "hf.jsonl")
    assert [r["source"] for r in v] == [r["source"] for r in hf] and summary["written"] == 40
    same = sum(a == b for a, b in zip(v, hf))
    print(f"vllm vs transformers, float32 greedy: {same} of {len(v)} replies identical")
    # float32 logits agree to ~1e-6, but a near-tie between two tokens can still go either way in
    # one reply, and everything after it differs: most replies, not all, are byte-identical.
    assert same >= 0.9 * len(v)


@pytest.mark.slow
def test_kill_9_mid_vllm_run_then_rerun_matches_the_uninterrupted_vllm_run(vllm_runs):
    """The kill is its own process (the claim); the rerun shares one engine with the reference run."""
    reference, _ = vllm_runs["reference"]
    output, done, resumed = vllm_runs["killed"]
    assert 4 <= done < 40 and resumed["resumed_from"] == done
    assert output.read_bytes() == reference.read_bytes()
