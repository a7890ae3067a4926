"""`dspark regenerate`: the verifier writes its own replies to the prompts of a chat file.

A drafter learns to predict what its verifier says. Public chat dumps hold other models' replies;
regenerating them with the verifier (speculators calls it response regeneration) makes the
training targets the verifier's own outputs, so what training measures is what serving sees.

Per conversation (read by `dspark.data.prepare.read_conversations`: OpenAI `messages`, ShareGPT
`conversations` or a JSON array, with its roles, repairs and drop reasons), the prompt is every
turn before the first assistant turn (system and user turns), rendered with the verifier's chat
template and generation prompt as `dspark eval --decode` renders prompts
(`dspark.data.prompts.render_prompt`). One line per prompt, which `dspark prepare` reads (it
ignores `source`):

    {"messages": [...prompt turns, {"role": "assistant", "content": REPLY}],
     "source": {"index": 7, "where": "chat.jsonl:8"}}

`index` counts the conversations the reader kept, `where` is the input's file name and line.
First turn only by default. `--turns N` (0: all) answers the conversation's later user turns too,
on-policy: each later reply is generated after the verifier's own earlier replies, the user turns
kept as the file has them; a batch is answered round by round, one batched call per turn. A
conversation stops early (counted by reason in `turns_ended`) at a reply cut at --max-new-tokens
or blank, or where its next prompt is too long; it keeps the replies it has. A conversation without
an assistant turn (questions only, as MT-bench's) is a prompt too: its turns up to and including
the first user turn (the later questions ask about a reply the file does not hold).

Replies are plain greedy decoding (`--temperature 0`, the default) or plain temperature sampling,
stopped by the tokenizer's and generation_config's end-of-turn tokens, the same in both engines:
the model's generation_config sampling defaults (top-p, repetition penalty, ...) are not applied.
The text is the reply's tokens decoded without the stop token and special tokens; `dspark prepare`
tokenizes it again (the same tokens, except where the model produced a non-canonical split).

Counted, never fatal one by one (`dropped_by_reason` in the summary): the reader's reasons,
`no_user_turn`, `chat_template_error`, prompts too long for the verifier's maximum length minus
`--max-new-tokens`, and `empty_reply` (a reply that is blank: nothing to train on). Replies cut at
`--max-new-tokens` are kept and counted as `truncated`.

Crash safety. Files: OUTPUT, OUTPUT.regenerate.json (the commit record: settings fingerprint,
prompts done, committed bytes, counts) and OUTPUT.summary.json (the last run's summary). One
writer per OUTPUT: a run holds an flock on it (a second run is refused; the kernel drops the lock
when its holder dies, so a kill -9 leaves nothing to clean up). Prompts go in batches of
`--batch-size` in input order; each batch's lines are appended and fsynced, then the commit
record is replaced (temp file, fsync, rename). The record is the
commit point: a rerun truncates OUTPUT to the committed bytes (a torn last line from a kill -9,
or lines of a batch whose record never landed) and continues with the next prompt, so every
prompt is written exactly once, in input order. A resumed run feeds the engine the same batches
as an uninterrupted one and seeds sampling from --seed and the prompt's position, so its output
is byte-identical (with the same --batch-size). The fingerprint pins what decides the replies
(model config, tokenizer, a sample of the weight bytes, the data file, engine, dtype,
max_new_tokens, temperature, seed); a rerun with any of them changed is refused. --batch-size,
--device and --max-prompts may change between runs (a larger --max-prompts extends the file).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from dspark.core.settings import check_settings, setting
from dspark.core.errors import InputError
from dspark.core.files import open_regular
from dspark.core.fsio import write_atomic
from dspark.core.jsonio import dump_json
from dspark.core.outputs import check_output, writing
from dspark.core.registry import Registry
from dspark.core.records import integer, mapping, optional, read_record
from dspark.verifier.info import VerifierInfo
from dspark.verifier.check import check_verifier_config

FORMAT = 1
DTYPES = ("float32", "bfloat16", "float16")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass
class RegenerateConfig:
    model: str = setting(help="Verifier folder (or cached hub id): its chat template renders the prompts, its weights write the replies.")
    data: str = setting(help="Chat file: JSONL with OpenAI `messages` or ShareGPT `conversations`, or a JSON array.")
    output: str = setting(help="Chat JSONL to write (resumed if it exists), with OUTPUT.regenerate.json beside it.")
    engine: Literal[GENERATORS.choices()] = setting(
        "transformers", "transformers: AutoModelForCausalLM.generate; vllm: vllm.LLM in-process (run from .venv-vllm).")
    max_new_tokens: int = setting(512, "Longest reply in tokens; longer ones are cut, kept and counted (truncated).",
                                  ge=1)
    temperature: float = setting(0.0, "0: greedy (what the verifier says most likely); > 0: plain sampling.", ge=0)
    seed: int = setting(0, "Sampling seed, offset by each batch's position: a resumed run samples what an "
                           "uninterrupted one does.")
    turns: int = setting(
        1, "User turns answered per conversation, each reply written after the verifier's own earlier replies "
           "(on-policy multi-turn); 0: every user turn.", ge=0)
    batch_size: int = setting(16, "Prompts per generate call (and per fsync'd commit).", ge=1)
    max_prompts: int | None = setting(None, "Only the first N usable prompts (a larger N later extends the file).",
                                      ge=1)
    max_prompt_tokens: int | None = setting(
        None, "Skip (and count) longer prompts: a reply after a prompt longer than prepare's --seq-length is "
              "never trained on, and long prompts cost the most to regenerate.", ge=1)
    device: str = setting("cpu", "transformers engine: torch device (vLLM picks its own platform).")
    dtype: str | None = setting(None, "Verifier dtype: float32, bfloat16 or float16 (default: its config's).")
    trust_remote_code: bool = setting(False, "Allow custom model code from the model folder.", negatable=False)

    def __post_init__(self):
        check_settings(self)
        if self.dtype not in (None, *DTYPES):
            raise InputError(f"--dtype {self.dtype!r} is not supported", f"use one of {list(DTYPES)}")


@dataclass(frozen=True)
class Prompt:
    index: int              # position among the conversations the reader kept
    where: str              # "chat.jsonl:8": the input's file name and line (or JSON-array record)
    turns: list[dict]       # the conversation before its first assistant turn
    ids: list[int]          # the turns rendered with the generation prompt
    later: list[list[dict]] = field(default_factory=list)  # the turns each later reply answers (--turns)


@dataclass(frozen=True)
class Generation:
    text: str               # the reply, without its stop token or special tokens
    token_ids: list[int]    # the reply's tokens, without the stop token
    finished: bool          # ended by a stop token (False: cut at max_new_tokens)


# --- engines -----------------------------------------------------------------------------------


class Generator(ABC):
    """A verifier runtime that writes replies.

        construct                 loads the verifier (the slow part; after the settings check)
        generate(prompts, seed)   one Generation per prompt, in order; the same call with the same
                                  seed samples the same replies (vLLM: prompt j from seed + j;
                                  transformers: one stream per call); greedy ignores it
        close()                   releases the engine
    """

    @abstractmethod
    def generate(self, prompts: list[list[int]], seed: int) -> list[Generation]: ...

    def close(self) -> None:
        """Nothing held beyond memory by default."""


GENERATORS: Registry[type[Generator]] = Registry("engine", "--engine")


def _reply(tokenizer, ids: list[int], stop: set[int], finished: bool) -> Generation:
    ids = list(ids)
    if finished and ids and ids[-1] in stop:
        ids.pop()
    text = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return Generation(text, ids, finished)


@GENERATORS.register("transformers")
class TransformersGenerator(Generator):
    """`generate` on left-padded batches (positions come from the attention mask, so padding is invisible)."""

    def __init__(self, cfg: RegenerateConfig, tokenizer, stop: list[int], dtype: str):
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.torch, self.tokenizer, self.stop, self.cfg = torch, tokenizer, stop, cfg
        self.device = torch.device(cfg.device)
        check_verifier_config(cfg.model, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(
            cfg.model, dtype=getattr(torch, dtype), trust_remote_code=cfg.trust_remote_code).to(self.device).eval()
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
        # A blank generation_config: the model's own sampling defaults would otherwise fill every unset value.
        self.model.generation_config = GenerationConfig()
        sampling = {"temperature": cfg.temperature, "top_k": 0, "top_p": 1.0} if cfg.temperature > 0 else {}
        self.gen_config = GenerationConfig(max_new_tokens=cfg.max_new_tokens, do_sample=bool(sampling),
                                           eos_token_id=list(stop), pad_token_id=self.pad, **sampling)

    def generate(self, prompts: list[list[int]], seed: int) -> list[Generation]:
        torch = self.torch
        T = max(map(len, prompts))
        input_ids = torch.full((len(prompts), T), self.pad, dtype=torch.long)
        attn = torch.zeros(len(prompts), T, dtype=torch.long)
        for i, ids in enumerate(prompts):
            input_ids[i, T - len(ids):] = torch.as_tensor(ids)
            attn[i, T - len(ids):] = 1
        # generate() samples from the global RNG, one stream per batch: seeded per batch, so a
        # resumed run (same batches) samples what the uninterrupted one did.
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attn.to(self.device),
                                      generation_config=self.gen_config)
        stop = set(self.stop)
        results = []
        for row in out[:, T:].tolist():
            end = next((k for k, t in enumerate(row) if t in stop), None)
            results.append(_reply(self.tokenizer, row if end is None else row[: end + 1], stop, end is not None))
        return results


@GENERATORS.register("vllm")
class VllmGenerator(Generator):
    """`vllm.LLM.generate` on token ids, engine core in this process (as `dspark extract --engine vllm`)."""

    def __init__(self, cfg: RegenerateConfig, tokenizer, stop: list[int], dtype: str):
        try:
            from vllm import LLM
        except ImportError:
            raise InputError("vLLM is not installed in this environment",
                             "run from .venv-vllm (bash scripts/setup.sh --vllm), or use --engine transformers"
                             ) from None
        import torch

        from dspark.vllm_server import cpu_env

        os.environ.update(cpu_env())
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # a kill -9 leaves no orphaned engine behind
        self.tokenizer, self.stop, self.cfg = tokenizer, stop, cfg
        check_verifier_config(cfg.model, dtype, host_memory=not torch.cuda.is_available())
        self.llm = LLM(model=str(cfg.model), dtype=dtype, seed=cfg.seed, trust_remote_code=cfg.trust_remote_code,
                       enforce_eager=not torch.cuda.is_available(),  # CPU: compiling costs ~50 s of startup
                       disable_log_stats=True)

    def generate(self, prompts: list[list[int]], seed: int) -> list[Generation]:
        from vllm import SamplingParams

        sample = self.cfg.temperature > 0
        params = [SamplingParams(max_tokens=self.cfg.max_new_tokens, temperature=self.cfg.temperature,
                                 stop_token_ids=list(self.stop), seed=seed + j if sample else None, detokenize=False)
                  for j in range(len(prompts))]
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        stop = set(self.stop)
        return [_reply(self.tokenizer, o.outputs[0].token_ids, stop, o.outputs[0].finish_reason == "stop")
                for o in outs]

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


# --- prompts and settings ----------------------------------------------------------------------


def stop_token_ids(model: Path, tokenizer) -> list[int]:
    """The tokenizer's eos plus generation_config.json's eos_token_id(s): what ends a reply."""
    ids = [tokenizer.eos_token_id]
    gen = model / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos]
    stop = sorted({i for i in ids if isinstance(i, int)})
    if not stop:
        raise InputError(f"the verifier in {model} names no end-of-sequence token",
                         "set eos_token in its tokenizer_config.json or eos_token_id in generation_config.json")
    return stop


def weights_sample_hash(model: Path, block: int = 1 << 20) -> str:
    """sha256 over each weight file's name, size, first and last MiB: cheap on a 100 GB checkpoint,
    and any retraining changes the tensors at the end of a file."""
    h = hashlib.sha256()
    for p in sorted(q for q in model.iterdir() if q.name.endswith(WEIGHT_SUFFIXES)):
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            h.update(f.read(block))
            f.seek(max(0, size - block))
            h.update(f.read(block))
    return h.hexdigest()


def load_prompts(cfg: RegenerateConfig, tokenizer, max_length: int | None):
    """The usable prompts in input order (the first `max_prompts`), drops by reason, and what was read."""
    from dspark.data.prompts import later_turns, prompt_turns
    from dspark.data.prepare import read_conversations

    path = Path(cfg.data)
    data = read_conversations(path, require_assistant=False)
    dropped = Counter(data.dropped)
    if max_length is not None and max_length - cfg.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens {cfg.max_new_tokens} leaves no room for a prompt in the verifier's "
                         f"maximum length ({max_length})", f"pass --max-new-tokens below {max_length}")
    prompts: list[Prompt] = []
    for index, (messages, where) in enumerate(zip(data.conversations, data.where)):
        turns = prompt_turns(messages)
        if turns is None:
            dropped["no_user_turn"] += 1
            continue
        ids, refused = render(cfg, tokenizer, max_length, turns)
        if refused:
            dropped[refused] += 1
            continue
        later = later_turns(messages)[: cfg.turns - 1 if cfg.turns else None]  # --turns 0: all
        prompts.append(Prompt(index, path.name + where.removeprefix(str(path)), turns, ids, later))
        if cfg.max_prompts is not None and len(prompts) >= cfg.max_prompts:
            break
    if not prompts:
        counts = ", ".join(f"{r}: {n}" for r, n in dropped.most_common(3)) or "it is empty"
        raise InputError(f"{path} has no usable prompt ({counts})",
                         "pass conversations with a user turn before their first assistant reply")
    return prompts, dropped, data


def render(cfg: RegenerateConfig, tokenizer, max_length: int | None,
           turns: list[dict]) -> tuple[list[int], str | None]:
    """The turns rendered with the generation prompt, and why they are not answered (None: they are)."""
    from jinja2 import TemplateError

    from dspark.data.prompts import render_prompt, too_long_reason

    try:
        ids = render_prompt(tokenizer, turns)
    except TemplateError:
        return [], "chat_template_error"
    if max_length is not None and len(ids) > max_length - cfg.max_new_tokens:
        return ids, too_long_reason(max_length, cfg.max_new_tokens)
    if cfg.max_prompt_tokens is not None and len(ids) > cfg.max_prompt_tokens:
        return ids, f"longer than --max-prompt-tokens {cfg.max_prompt_tokens}"
    return ids, None


def settings_key(cfg: RegenerateConfig, dtype: str) -> dict:
    """Everything that decides the replies (not how fast they come: batch size, device, max_prompts)."""
    from dspark.verifier.fingerprint import model_config_hash, sha256_files, tokenizer_hash

    model = Path(cfg.model)
    return {"format": FORMAT, "model_config": model_config_hash(model), "tokenizer": tokenizer_hash(model),
            "weights_sample": weights_sample_hash(model), "data": sha256_files([Path(cfg.data)]),
            "engine": cfg.engine, "dtype": dtype, "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature, "seed": cfg.seed, "max_prompt_tokens": cfg.max_prompt_tokens,
            # one turn is what every output written before --turns holds: those records stay resumable
            **({"turns": cfg.turns} if cfg.turns != 1 else {})}


def sidecar(output: Path, suffix: str) -> Path:
    return output.with_name(output.name + suffix)


# --- the commit record -------------------------------------------------------------------------


@dataclass
class Record:
    settings: dict
    done: int = 0             # prompts processed (written or dropped), a prefix of the input order
    bytes: int = 0            # OUTPUT's committed length
    written: int = 0
    truncated: int = 0        # replies cut at --max-new-tokens
    replies: int = 0          # replies written (more than `written` with --turns)
    turns_ended: dict = field(default_factory=dict)  # reason -> conversations that stopped before their last turn
    dropped: dict = field(default_factory=dict)  # reason -> count, of drops at generation (empty_reply)
    generated_tokens: int = 0  # over all runs

    def commit(self, path: Path) -> None:
        """Replace the record atomically and durably: a crash leaves the old one or the new one, never half."""
        write_atomic(path, json.dumps(asdict(self), indent=1))


# What a rerun reads back of the record (dspark.core.records): each count a non-negative integer.
RECORD_SCHEMA = {"settings": mapping(), "done": integer(0), "bytes": integer(0),
                 **{k: optional(integer(0)) for k in ("written", "truncated", "replies", "generated_tokens")},
                 **{k: optional(mapping(values=integer(0))) for k in ("turns_ended", "dropped")}}


def resume(output: Path, settings: dict) -> tuple[Record, bool]:
    """The committed state of OUTPUT (a fresh one for an empty file), OUTPUT cut to it; and whether it resumed."""
    path = sidecar(output, ".regenerate.json")
    start_over = f"choose another --output, or delete {output} and {path.name} to start over"
    if output.stat().st_size == 0 and not path.exists():  # new (regenerate() has just created it)
        return Record(settings), False
    if not path.is_file():
        raise InputError(f"{output} exists but has no {path.name} beside it, so it was not written by "
                         "`dspark regenerate` (or its record was lost) and cannot be resumed", start_over)
    raw = read_record(path, RECORD_SCHEMA, start_over)
    # before --turns a record had no `replies`: one reply a conversation
    record = Record(**{"replies": raw.get("written", 0), **{k: raw[k] for k in RECORD_SCHEMA if k in raw}})
    differ = [f"{k} {record.settings.get(k)!r} -> {v!r}" for k, v in settings.items() if record.settings.get(k) != v]
    if differ:
        raise InputError(f"{output} was made from another model, data or settings ({'; '.join(differ)})",
                         f"rerun with the settings recorded in {path}, or {start_over}")
    size = output.stat().st_size
    if size < record.bytes:
        raise InputError(f"{output} holds {size} bytes but {record.bytes} were committed: it was cut or edited "
                         "after the run", start_over)
    lines, whole = committed_lines(output, record.bytes)
    if not whole or lines != record.written:  # not this file's record: cutting OUTPUT to it would lose lines
        held = "ends mid-line" if not whole else f"holds {lines} lines, not the {record.written} written"
        raise InputError(f"{path}: field bytes is {record.bytes}, but that much of {output} {held}: the record "
                         "does not match the file", f"restore the record that belongs to {output.name}, or "
                                                    f"{start_over}")
    if size > record.bytes:
        # A torn line or a batch whose commit never landed: the next run writes those prompts again.
        os.truncate(output, record.bytes)
    return record, True


def committed_lines(output: Path, n: int, block: int = 8 << 20) -> tuple[int, bool]:
    """The lines in the first `n` bytes of `output` (the part a record commits), and whether they end whole."""
    count, last = 0, b"\n"
    with open_regular(output) as f:
        while n > 0 and (data := f.read(min(n, block))):
            count, last, n = count + data.count(b"\n"), data[-1:], n - len(data)
    return count, last == b"\n"


# --- the run -----------------------------------------------------------------------------------

ROUND_SEED = 1_000_003  # seed offset per turn: the rounds of one batch never sample from one seed


def converse(engine: Generator, cfg: RegenerateConfig, tokenizer, batch: list[Prompt], seed: int,
             max_length: int | None, record: Record) -> tuple[list[list[dict] | None], int]:
    """Each prompt's conversation with the verifier's replies (None: its first reply was blank), answered turn by
    turn, one batched call per turn; and the tokens generated. Cut replies, blank first replies and the
    conversations that stop early are counted into `record`."""
    talks = [list(p.turns) for p in batch]
    out: list[list[dict] | None] = [None] * len(batch)
    asks = {i: p.ids for i, p in enumerate(batch)}  # conversations with a turn to answer: its prompt's tokens
    tokens, turn, ended = 0, 0, Counter()
    while asks:
        order = sorted(asks)
        replies = engine.generate([asks[i] for i in order], seed + turn * ROUND_SEED)
        asks = {}
        for i, g in zip(order, replies):
            tokens += len(g.token_ids) + g.finished  # the stop token was generated too
            if not g.text.strip():
                if turn == 0:
                    record.dropped["empty_reply"] = record.dropped.get("empty_reply", 0) + 1
                else:
                    ended["blank_reply"] += 1
                continue
            record.truncated += not g.finished
            talks[i].append({"role": "assistant", "content": g.text})
            out[i] = list(talks[i])
            if turn == len(batch[i].later):
                continue
            if not g.finished:  # the next question would answer a reply cut short
                ended["cut_reply"] += 1
                continue
            talks[i] += batch[i].later[turn]
            ids, refused = render(cfg, tokenizer, max_length, talks[i])
            if refused:
                ended[refused] += 1
                continue
            asks[i] = ids
        turn += 1
    for reason, n in ended.items():
        record.turns_ended[reason] = record.turns_ended.get(reason, 0) + n
    return out, tokens


def regenerate(cfg: RegenerateConfig, progress: bool = True) -> dict:
    """Write (or resume, or find complete) the regenerated chat file; returns the summary."""
    from dspark.data.prepare import load_tokenizer

    start_time = time.perf_counter()
    check_settings(cfg)
    model, output = Path(cfg.model), Path(cfg.output)
    # An existing OUTPUT is this command's own when its record is beside it: resume() decides that.
    check_output("--output", output, folder=False, taken=[("--model", model), ("--data", Path(cfg.data))])
    info = VerifierInfo.load(model, fix="pass --model a local Hugging Face model folder")
    tokenizer = load_tokenizer(model, cfg.trust_remote_code)
    dtype = cfg.dtype or info.weights_dtype or "float32"
    stop = stop_token_ids(model, tokenizer)
    prompts, dropped, read = load_prompts(cfg, tokenizer, info.max_position_embeddings)
    settings = settings_key(cfg, dtype)
    output.parent.mkdir(parents=True, exist_ok=True)
    with writing(output, "the prompts committed before are kept: rerun the same command to resume after them"), \
            open(output, "ab") as f:  # appends land at the end, also after resume() truncates
        lock(f, output)
        record, resumed = resume(output, settings)
        return _run(cfg, f, record, resumed, prompts, dropped, read, tokenizer, stop, dtype, start_time, progress,
                    info.max_position_embeddings)


def lock(f, output: Path) -> None:
    """One writer per output: two would interleave batches. The kernel drops the lock when its holder dies."""
    import fcntl

    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise InputError(f"another `dspark regenerate` is writing {output}",
                         "wait for it to finish (or stop it), or choose another --output") from None


def _run(cfg, f, record: Record, resumed: bool, prompts: list[Prompt], dropped: Counter, read, tokenizer, stop,
         dtype: str, start_time: float, progress: bool, max_length: int | None) -> dict:
    from tqdm import tqdm

    output, resumed_from = Path(cfg.output), record.done
    record_path = sidecar(output, ".regenerate.json")

    def summary(up_to_date: bool, tokens: int, seconds: float, note: str) -> dict:
        """`seconds` and `tokens_per_s` time the generation of this run; `total_seconds` includes loading."""
        reasons = Counter(dropped) + Counter(record.dropped)
        result = {"output": str(output), "engine": cfg.engine, "conversations": read.records,
                  "prompts": len(prompts), "written": record.written, "replies": record.replies,
                  "resumed_from": resumed_from, "truncated": record.truncated,
                  "turns_ended": dict(Counter(record.turns_ended).most_common()), "dropped": sum(reasons.values()),
                  "dropped_by_reason": dict(reasons.most_common()), "generated_tokens": tokens,
                  "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1) if tokens else None,
                  "total_seconds": round(time.perf_counter() - start_time, 2), "up_to_date": up_to_date, "note": note}
        if read.cut_warning:  # a JSON array cut off at its end: its complete records were used
            result["input_warning"] = read.cut_warning
        write_atomic(sidecar(output, ".summary.json"), dump_json(result, indent=2) + "\n")
        return result

    if record.done >= len(prompts):
        more = f" (it holds {record.done}, more than --max-prompts {cfg.max_prompts})" if record.done > len(prompts) \
            else ""
        return summary(True, 0, time.perf_counter() - start_time,
                       f"complete: all {len(prompts)} prompts were done before{more}; nothing to do")
    engine = GENERATORS[cfg.engine](cfg, tokenizer, stop, dtype)
    if not resumed:  # only now, so an engine that fails to load leaves no record pinning its settings
        record.commit(record_path)
    gen_start, tokens = time.perf_counter(), 0
    bar = tqdm(total=len(prompts), initial=record.done, desc="regenerate", unit="prompt", disable=not progress)
    try:
        for first in range(record.done, len(prompts), cfg.batch_size):
            batch = prompts[first: first + cfg.batch_size]
            conversations, batch_tokens = converse(engine, cfg, tokenizer, batch, cfg.seed + first, max_length, record)
            lines = []
            for p, messages in zip(batch, conversations):
                if messages is None:  # its first reply was blank: nothing to train on
                    continue
                record.replies += sum(m["role"] == "assistant" for m in messages)
                lines.append(json.dumps({"messages": messages, "source": {"index": p.index, "where": p.where}},
                                        ensure_ascii=False) + "\n")
            blob = "".join(lines).encode()
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())  # the lines are durable before the record that commits them
            record.done, record.bytes = first + len(batch), record.bytes + len(blob)
            record.written += len(lines)
            record.generated_tokens += batch_tokens
            record.commit(record_path)
            tokens += batch_tokens
            bar.update(len(batch))
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - gen_start):.0f} tok/s")
    finally:
        bar.close()
        engine.close()
    note = f"resumed at prompt {resumed_from}" if resumed else "written"
    return summary(False, tokens, time.perf_counter() - gen_start, note)
