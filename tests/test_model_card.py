"""`dspark export`'s model card: specs, the commands that made the drafter, serving, acceptance, no local path."""

import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import LAYERS, fit, run_cli, train_cfg
from dspark.export.card import learning_curve
from dspark.export.folder import export

VERIFIER = "Org/Tiny"
# An absolute path: a "/" not inside a word, a URL or a placeholder. `/drafter` is the folder inside the container.
ABSOLUTE = re.compile(r"(?<![\w.:/<>~-])[~.]{0,2}/[\w.@+-]+")


@pytest.fixture(scope="module")
def run(store, prepared, verifier, tmp_path_factory):
    """A short run with settings of its own (block size 6, Markov rank 8), its latest checkpoint evaluated."""
    from dspark.eval.config import TeacherForcedConfig
    from dspark.eval.teacher_forced import run_eval

    c = train_cfg(store, prepared, verifier, tmp_path_factory.mktemp("card") / "run", block_size=6, markov_rank=8,
                  max_anchors=16, epochs=1, checkpoint_freq=0.5, log_freq=2)
    fit(c)
    root = Path(c.save_path)
    run_eval(TeacherForcedConfig(checkpoint=str(root / "latest"), store=str(store), split="val", device="cpu"))
    return root


def checkpoints(root: Path) -> list[Path]:
    return sorted((root / "checkpoints").iterdir())


def local_paths(text: str) -> list[str]:
    return [p for p in ABSOLUTE.findall(text) if p != "/drafter"]


def test_card_has_specs_commands_figures_and_no_local_path(run, verifier, prepared, store, chat_file, tmp_path):
    out = tmp_path / "export"
    result = export(str(run / "latest"), str(out), VERIFIER)
    card = (out / "README.md").read_text()

    for place in (verifier, prepared, store, chat_file, run, out, tmp_path, Path(tmp_path).parents[1]):
        assert str(place) not in card
    assert local_paths(card) == []
    assert "base_model: Org/Tiny" in card and "| Block size | 6 |" in card and "| Speculative tokens | 6 |" in card
    assert "| Markov head | rank 8, `vanilla` |" in card and "| Target layer ids | 1, 3, 5 (of the verifier's 6" in card
    assert "| Draft vocabulary | 512 of the verifier's 512 (full vocabulary) |" in card

    # The three commands, with the settings this run was made with.
    commands = card[card.index("```bash\ndspark prepare"):]
    commands = commands[:commands.index("```", 8)].replace("\\\n    ", "")
    prepare, extract, train = (line for line in commands.splitlines() if line.startswith("dspark "))
    assert prepare == ("dspark prepare --model <verifier> --data <chat.jsonl> --output <prepared> --seq-length 256 "
                       "--num-preprocessing-workers 1 --minimum-valid-tokens 8")
    assert extract == ("dspark extract --to zarr --model <verifier> --data <prepared> --store <store> "
                       f"--target-layer-ids {' '.join(map(str, LAYERS))} --dtype bfloat16")
    for flag in ("--data-path <prepared>", "--verifier-name-or-path <verifier>", "--save-path <run>",
                 "--target-layer-ids 1 3 5", "--from zarr", "--store <store>", "--block-size 6", "--markov-rank 8",
                 "--max-anchors 16", "--epochs 1", "--checkpoint-freq 0.5", "--total-seq-len 512", "--lr 0.003",
                 "--loss-fn '{\"ce\": 0.1, \"tv\": 0.9}'", "--enable-confidence-head", "--log-freq 2", "--seed 0"):
        assert f" {flag} " in f"{train} ", flag
    assert "--num-workers" not in train and "--device" not in train  # they do not change the drafter
    assert "`<chat.jsonl>` was a file named `chat.jsonl`" in card

    # Final figures from metrics.jsonl.
    last_val = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert last_val["split"] == "val"
    assert f"| validation (this checkpoint) | {last_val['step']} |" in card

    # Serving: V2, docker, and the dflash warning, in the card and in what export returns.
    assert "VLLM_USE_V2_MODEL_RUNNER=1 vllm serve Org/Tiny --speculative-config '{\"model\": \"<drafter>\", " \
           "\"method\": \"dspark\", \"num_speculative_tokens\": 6" in card
    assert "docker run --gpus all -e VLLM_USE_V2_MODEL_RUNNER=1 -p 8000:8000 -v <export>:/drafter vllm/vllm-openai " \
           "--model Org/Tiny --speculative-config '{\"model\": \"/drafter\", \"method\": \"dspark\"" in card
    assert "do not load this checkpoint with `method: dflash`" in card and "shifted by one" in card
    assert "do not load this checkpoint with `method: dflash`" in result["note"]
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in result["note"] and "Triton" in result["note"]
    assert result["serve"].startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve Org/Tiny")

    # Acceptance: this checkpoint's eval report and figure; no decode report yet, and how to make one.
    eval_md = (run / "latest" / "eval" / "eval.md").read_text()
    assert eval_md.splitlines()[2] in card and "![Teacher-forced acceptance (`dspark eval`)](eval.png)" in card
    assert (out / "eval.png").read_bytes() == (run / "latest" / "eval" / "eval.png").read_bytes()
    assert f"dspark eval --checkpoint <run>/checkpoints/{(run / 'latest').resolve().name} --decode --prompts" \
           in card
    assert sorted(result["files"]) == sorted(p.name for p in out.iterdir())

    again = export(str(run / "latest"), str(out), VERIFIER)  # a rerun into its own export is fine
    assert (out / "README.md").read_text() == card and again["files"] == result["files"]


def test_report_of_another_checkpoint_is_not_embedded(run, tmp_path):
    first, latest = checkpoints(run)[0], checkpoints(run)[-1]
    assert first != latest
    copy = tmp_path / "run"
    shutil.copytree(run, copy, symlinks=True)
    shutil.copytree(latest / "eval", copy / "checkpoints" / first.name / "eval")  # the latest's report, misplaced
    out = tmp_path / "export"
    export(str(copy / "checkpoints" / first.name), str(out), VERIFIER)
    card = (out / "README.md").read_text()
    assert "| pos | tokens |" not in card and not (out / "eval.png").exists()
    assert "belongs to another checkpoint" in card and "No teacher-forced report for this checkpoint yet" in card

    # The copied run's latest has the same weights as the evaluated one: its report is shown.
    out2 = tmp_path / "export2"
    export(str(copy / "latest"), str(out2), VERIFIER)
    assert "| pos | tokens |" in (out2 / "README.md").read_text() and (out2 / "eval.png").exists()
    # Its report gone, a re-export drops the figure it had copied.
    shutil.rmtree(copy / "latest" / "eval")
    export(str(copy / "latest"), str(out2), VERIFIER)
    assert "| pos | tokens |" not in (out2 / "README.md").read_text() and not (out2 / "eval.png").exists()


def test_the_learning_curve_comes_from_validations_and_from_evals_of_checkpoints_not_validated(run, tmp_path):
    out = tmp_path / "export"
    export(str(run / "latest"), str(out), VERIFIER)
    card = (out / "README.md").read_text()
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r["split"] == "val"]
    assert len(val) == 2 and "### Learning curve" in card
    for r in val:  # tokens: steps x the 512-token packed batch
        m = r["metrics"]
        assert f"| {r['step']} | {r['step'] * 512 / 1e6:.2f}M | {m['real_tau']:.4g} | " \
               f"{m['state_gain_pos1_match']:+.3f} |" in card
    rise = val[1]["metrics"]["real_tau"] - val[0]["metrics"]["real_tau"]  # the verdict follows the last two points
    verdict = "Still rising" if rise > 0 else "Level or falling"
    assert f"{verdict} at the last point ({rise:+.3f})" in card

    # A run stopped by --max-steps between validations: the checkpoint's own `dspark eval` is its point, and a
    # checkpoint neither validated nor evaluated has none.
    curve = learning_curve(run, [r for r in records if r["split"] == "train"])
    e = json.loads(((run / "latest").resolve() / "eval" / "eval.json").read_text())
    assert curve == [{"step": val[-1]["step"], "tokens": val[-1]["step"] * 512, "tau": e["tau_greedy"],
                      "state_gain": e["state_gain"]["positions"][0]}]


def test_decode_report_is_embedded_without_local_paths(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy, symlinks=True)
    ckpt = (copy / "latest").resolve()
    rec = {"num_speculative_tokens": 3, "method": "dspark", "why": "two drafts accepted a third of the time pay"}
    (ckpt / "eval" / "decode.json").write_text(json.dumps({"checkpoint": str(ckpt), "datasets": {},
                                                           "recommendation": rec}))
    (ckpt / "eval" / "decode.md").write_text(
        f"# Speculative decoding\n\nprompts from {tmp_path}/prompts.jsonl on {ckpt}\n\n"
        "| dataset | tau |\n|---|---:|\n| chat | 3.21 |\n")
    shutil.copyfile(ckpt / "eval" / "eval.png", ckpt / "eval" / "decode.png")
    out = tmp_path / "export"
    result = export(str(copy / "latest"), str(out), VERIFIER)
    card = (out / "README.md").read_text()
    assert "| chat | 3.21 |" in card and "#### Speculative decoding" in card
    assert f"prompts from <path> on <run>/checkpoints/{ckpt.name}" in card
    assert "![Speculative decoding (`dspark eval --decode`)](decode.png)" in card and (out / "decode.png").exists()
    assert "decode.png" in result["files"] and "No speculative-decoding report" not in card
    assert str(tmp_path) not in card and local_paths(card) == []
    # the measured draft count: in the card's serve commands and its why, and in serving.json for serve-draft
    assert json.loads((out / "serving.json").read_text()) == rec and "serving.json" in result["files"]
    assert '"num_speculative_tokens": 3' in result["serve"] and '"num_speculative_tokens": 3' in card
    assert "**Measured draft count** for `method: dspark`: `num_speculative_tokens` 3 (the commands above use it). " \
           "Why: two drafts accepted a third of the time pay." in card
    (ckpt / "eval" / "decode.json").write_text(json.dumps({"checkpoint": str(ckpt), "datasets": {}}))
    again = export(str(copy / "latest"), str(out), VERIFIER, force=True)
    assert not (out / "serving.json").exists() and "serving.json" not in again["files"]  # no stale count


def test_checkpoint_without_anchor_sampling_outside_a_run(run, tmp_path):
    bare = tmp_path / "bare"
    # edited by hand below, so without the checksums a save writes (they would call the edit damage)
    shutil.copytree((run / "latest").resolve(), bare, ignore=shutil.ignore_patterns("eval", "checksums.json"))
    config = json.loads((bare / "config.json").read_text())
    config["sample_from_anchor"] = False
    (bare / "config.json").write_text(json.dumps(config))
    out = tmp_path / "export"
    proc = run_cli("export", bare, "--output", out, "--verifier-name", VERIFIER)
    assert '"method": "dspark"' in proc.stdout
    card = (out / "README.md").read_text()
    assert "`method: dflash` also serves it correctly" in card and "do not load" not in card
    assert "\"method\": \"dflash\"" in card and "Markov head is then unused" in card
    assert "not inside a dspark run folder" in card and "dspark train" not in card
    assert "dspark eval --checkpoint <checkpoint> --store <store>" in card
    assert str(tmp_path) not in card and local_paths(card) == []
    assert "also serves it correctly" in export(str(bare), str(out), VERIFIER)["note"]


def test_train_command_of_a_live_distributed_run():
    from dspark.export.commands import train_command
    from dspark.export.provenance import Provenance
    from dspark.train.config import TrainConfig

    t = TrainConfig(data_path="/data/p", verifier_name_or_path="/models/v", save_path="/runs/r",
                    target_layer_ids=[2, 4], source="mooncake", store="/cache/c")
    t.live.endpoint = "http://10.1.2.3:8000/v1"
    t.live.mooncake.master = "10.1.2.3:50051"
    cmd = train_command(Provenance(record={"world_size": 4}, train=t.to_dict()))
    assert cmd.startswith("torchrun --nproc_per_node 4 scripts/train.py ")
    flat = cmd.replace("\\\n    ", "")
    for flag in ("--from mooncake", "--store <store>", "--vllm-endpoint <endpoint>",
                 "--mooncake-master <mooncake-master>", "--target-layer-ids 2 4"):
        assert flag in flat, flag
    assert "10.1.2" not in cmd and "/data" not in cmd and "--on-missing" not in cmd  # defaults of live left out


def test_the_card_commands_remake_the_run(run, verifier, chat_file, tmp_path):
    """The card's prepare, extract and train lines, placeholders filled in, make the same data, store and settings."""
    import shlex

    from dspark.connector.manifest import IDENTITY_FIELDS
    from dspark.train.config import RESULT_NEUTRAL

    out = tmp_path / "export"
    export(str(run / "latest"), str(out), VERIFIER)
    card = (out / "README.md").read_text()
    block = card[card.index("```bash\ndspark prepare") + len("```bash\n"):]
    block = block[:block.index("```")].replace("\\\n    ", "")
    places = {"<verifier>": verifier, "<chat.jsonl>": chat_file, "<prepared>": tmp_path / "prepared",
              "<store>": tmp_path / "store", "<run>": tmp_path / "run"}
    lines = [line for line in block.splitlines() if line.strip()]
    assert [line.split()[1] for line in lines] == ["prepare", "extract", "train"]
    argv = [[str(places.get(w, w)) for w in shlex.split(line)[1:]] for line in lines]

    record = json.loads((run / "config.json").read_text())
    run_cli(*argv[0])
    assert json.loads((tmp_path / "prepared" / "prepare.json").read_text())["fingerprint"] == \
        record["prepared_fingerprint"]
    run_cli(*argv[1], "--no-progress")
    made, theirs = (json.loads((p / "manifest.json").read_text())
                    for p in (tmp_path / "store", Path(record["train"]["store"])))
    assert {k: made[k] for k in IDENTITY_FIELDS} == {k: theirs[k] for k in IDENTITY_FIELDS}
    settings = json.loads(run_cli(*argv[2], "--print-config").stdout)
    for key in set(settings) - RESULT_NEUTRAL - {"data_path", "verifier_name_or_path", "store"}:
        assert settings[key] == record["train"][key], key
