"""`dspark toy-verifier`: a tiny, briefly pre-trained Qwen3 verifier built offline.

It is the embedded default for the demo and the tests: a BPE tokenizer trained
with `tokenizers` on the shipped chat data (ChatML template, a mask token for
DFlash), and a few-layer Qwen3 pre-trained on the same conversations so that its
next-token distribution has structure a drafter can learn.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dspark.core.settings import setting

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]


@dataclass(frozen=True)
class ToySpec:
    vocab_size: int = setting(512, cli=False)
    hidden_size: int = setting(128, cli=False)
    num_layers: int = setting(6, cli=False)
    num_heads: int = setting(4, cli=False)
    num_kv_heads: int = setting(2, cli=False)
    intermediate_size: int = setting(384, cli=False)
    steps: int = setting(150, "Pre-training steps.", ge=0)
    batch_size: int = setting(16, cli=False)
    seq_len: int = setting(128, cli=False)
    lr: float = setting(3e-3, cli=False)
    seed: int = setting(0)
    max_position_embeddings: int = setting(
        4096, "Longest context; long-context evals need more (e.g. 32768).", ge=64)


@dataclass
class ToyVerifierConfig:
    """`dspark toy-verifier`: where to write it, and its pre-training."""

    output: str = setting("cache/models/tiny", "The model folder to write.")
    spec: ToySpec = setting(factory=ToySpec, prefixed=False)


def demo_chat_path() -> Path:
    """The shipped demo conversations (JSONL, OpenAI `messages` format)."""
    return Path(str(resources.files("dspark") / "assets" / "demo_chat.jsonl"))


def _conversations(path: Path) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in path.read_text().splitlines() if line.strip()]


def build_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        mask_token="<|mask|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_toy_verifier(output: Path, spec: ToySpec = ToySpec(), data: Path | None = None) -> dict:
    """Train tokenizer + verifier and save both to `output`. Returns a summary."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    start = time.perf_counter()
    torch.manual_seed(spec.seed)
    convs = _conversations(data or demo_chat_path())
    # ChatML rendered by hand: the tokenizer that will carry CHAT_TEMPLATE is trained on these texts.
    texts = ["".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in c) for c in convs]
    tokenizer = build_tokenizer(texts, spec.vocab_size)
    stream = torch.tensor(
        [t for text in texts for t in tokenizer(text)["input_ids"]], dtype=torch.long
    )

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen3ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=spec.lr, total_steps=spec.steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(spec.seed)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(spec.steps):
        starts = torch.randint(0, len(stream) - spec.seq_len - 1, (spec.batch_size,), generator=gen)
        batch = torch.stack([stream[s : s + spec.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()

    output.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(output)
    tokenizer.save_pretrained(output)
    return {
        "output": str(output),
        "vocab_size": len(tokenizer),
        "layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "final_loss": round(loss.item(), 4),
        "seconds": round(time.perf_counter() - start, 1),
    }
