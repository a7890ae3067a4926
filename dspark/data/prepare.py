"""`dspark prepare`: chat JSONL -> token ids + an assistant-only loss mask.

The loss mask comes from the model's own chat template: for each supervised assistant
turn (`supervised_turns`: every one but a turn that opens the conversation) we render the
conversation up to the turn's generation prompt and up to the end of the turn; the characters
in between are the assistant's, and the tokens that cover them are supervised. This works for
any template with the usual prefix property, without `{% generation %}` markers.

Output folder (written to a temp folder, then renamed: never half-written):
  input_ids.npy  int32 [total_tokens]   all samples concatenated
  loss_mask.npy  uint8 [total_tokens]
  offsets.npy    int64 [num_samples+1]  sample i = [offsets[i], offsets[i+1])
  token_freq.pt  {token_id: count} over supervised tokens (draft-vocab input)
  prepare.json   config, stats, tokenizer hash, the data fingerprint and the files' record
                 (size and xxh3 of each file above: `PreparedData` refuses files changed since)
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import re
import signal
import threading
import zlib
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import cached_property
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from dspark.core import files as bounds, jsonio
from dspark.core.errors import InputError
from dspark.core.files import DataReader, FileRefused, file_xxh3
from dspark.verifier.fingerprint import sha256_files, sha256_json, tokenizer_hash
from dspark.core.outputs import check_output, output_lock, written_files
from dspark.core.settings import setting

# Role names public dumps use -> the chat template's roles. Matched case-insensitively;
# `--role-map` adds to or overrides this table. A conversation with a role found in
# neither is dropped (counted as `unknown_role:<name>`), never guessed.
ROLES = {
    "system": "system", "user": "user", "assistant": "assistant", "tool": "tool",
    "human": "user", "prompter": "user",                        # ShareGPT, OpenAssistant
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",  # ShareGPT
    "model": "assistant", "bot": "assistant", "ai": "assistant",  # Gemini-style and bot dumps
}
TEMPLATE_ROLES = ("system", "user", "assistant", "tool")
# Raised when the loss mask a conversation gets changes, so a folder prepared before is prepared again
# (2: an assistant turn that opens a conversation is context, no longer supervised with the template's header).
PREPARE_FORMAT = 2
RECORDED_FILES = ("input_ids.npy", "loss_mask.npy", "offsets.npy", "token_freq.pt")  # prepare.json records them
PREPARED_FILES = ("prepare.json", *RECORDED_FILES)
ARRAYS = {"input_ids.npy": np.int32, "loss_mask.npy": np.uint8, "offsets.npy": np.int64}
# A template that times out on each of the first conversations times out on every one: stop, not drop them all.
TIMEOUTS_BEFORE_GIVING_UP = 3
# Characters of one conversation's turns, checked before it is rendered or tokenized: the Rust tokenizer cannot be
# interrupted (no timeout reaches it) and takes ~0.5 GB and seconds per million characters (50 MB aborted it).
# A million characters is ~250k tokens, beyond any context a drafter trains or decodes in.
MAX_CONVERSATION_CHARS = 1_000_000
OVER_MAX_CHARS = "over_max_chars"  # the drop reason
OPENING_ASSISTANT_ONLY = "opening_assistant_only"  # the drop reason: no assistant turn but one that opens it


@dataclass(frozen=True)
class PrepareConfig:
    model: str = setting(help="Verifier folder or cached hub id (for its tokenizer and chat template).")
    data: str = setting(help="Chat JSONL: OpenAI `messages` or ShareGPT `conversations`.")
    output: str = setting(help="The prepared folder to write.")
    seq_length: int = setting(2048)
    num_preprocessing_workers: int = setting(1)
    minimum_valid_tokens: int = setting(1)
    trust_remote_code: bool = setting(False, negatable=False)
    role_map: str | dict | None = setting(
        None, "Extra role names, e.g. 'bing=assistant,foo=user' (or JSON). Built in: human/prompter=user; "
              "gpt/chatgpt/bing/bard/model/bot/ai=assistant. Conversations with other roles are dropped.",
        metavar="NAME=ROLE,...")
    strict: bool = setting(False, "Fail on the first conversation that would be dropped, naming its line.",
                           negatable=False)
    skip_invalid_lines: bool = setting(
        False, "Skip and count malformed-JSON and non-UTF-8 lines instead of failing on the first.", negatable=False)
    template_timeout: float = setting(
        5.0, "Seconds the chat template may take to render one conversation (real ones take ms); longer is dropped "
             "as template_timeout (an error with --strict). 0: no limit.", ge=0)


def load_tokenizer(model: str | Path, trust_remote_code: bool = False):
    """The verifier's tokenizer; refuses folders without one or without a chat template."""
    path = Path(model)
    if not path.is_dir():
        raise InputError(f"model folder {path} does not exist",
                         "pass --model a local folder holding config.json and the tokenizer files")
    from transformers import AutoTokenizer

    from dspark.verifier.check import check_verifier_config

    if (path / "config.json").is_file():  # transformers builds the model's config too, and fails in a traceback
        check_verifier_config(path, host_memory=False)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise InputError(f"could not load a tokenizer from {path}: {e}",
                         "the folder needs tokenizer.json (or the slow tokenizer files)") from e
    if not getattr(tok, "chat_template", None):
        raise InputError(f"the tokenizer in {path} has no chat template",
                         "add chat_template.jinja (or chat_template in tokenizer_config.json) to the model folder")
    return tok


def parse_role_map(spec: str | dict | None) -> dict[str, str]:
    """`--role-map`: "bing=assistant,foo=user" or a JSON object; names are matched case-insensitively."""
    fix = 'write it as "bing=assistant,foo=user" or as JSON {"bing": "assistant"}'
    if not spec:
        return {}
    if isinstance(spec, str):
        if spec.lstrip().startswith("{"):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise InputError(f"--role-map is not valid JSON ({e.msg})", fix) from None
        else:
            pairs = [p.split("=", 1) for p in spec.split(",") if p.strip()]
            if any(len(p) != 2 for p in pairs):
                raise InputError(f"--role-map {spec!r} is not a list of name=role pairs", fix)
            spec = dict(pairs)
    if not isinstance(spec, dict):
        raise InputError("--role-map must map role names to roles", fix)
    out = {}
    for name, role in spec.items():
        target = str(role).strip().lower()
        if target not in TEMPLATE_ROLES:
            raise InputError(f"--role-map maps {name!r} to {role!r}, not a chat-template role",
                             f"map every name to one of {', '.join(TEMPLATE_ROLES)}")
        out[str(name).strip().lower()] = target
    return out


@dataclass
class ChatData:
    """What `read_conversations` kept, and what it dropped or skipped, by reason."""

    conversations: list[list[dict]]
    where: list[str]  # "path:line" of each kept conversation
    records: int = 0  # conversations read: kept + dropped
    invalid_lines: int = 0
    dropped: Counter = field(default_factory=Counter)
    first_drop: dict = field(default_factory=dict)  # reason -> "path:line: what" of its first case
    mapped_roles: Counter = field(default_factory=Counter)
    repaired: Counter = field(default_factory=Counter)
    cut_bytes: int = 0  # a JSON array that ends mid-record: the bytes after its last complete record
    cut_warning: str = ""  # ... and a sentence saying so


class _Drop(Exception):
    def __init__(self, reason: str, detail: str):
        self.reason, self.detail = reason, detail


class _Invalid(Exception):
    def __init__(self, detail: str, fix: str):
        self.detail, self.fix = detail, fix


SKIP_FIX = "or pass --skip-invalid-lines to skip and count such lines"
_SURROGATES = re.compile("[\ud800-\udfff]")


@contextmanager
def open_data(path: Path):
    """`path` as a `dspark.core.files.DataReader`: gzip (found by its magic bytes, not its name) is decompressed,
    a line is at most `MAX_LINE_BYTES` and a gzip stream inflates at most `GZIP_MAX_RATIO` times.

    A gzip stream that is damaged or cut off, or a read past a bound, is an `InputError` wherever the reading stops.
    """
    try:
        reader = DataReader(path)
    except (FileRefused, OSError) as e:
        raise InputError(f"{path} {e if isinstance(e, FileRefused) else f'cannot be read ({e.strerror})'}",
                         "pass a readable regular file") from None
    with reader as f:
        try:
            yield f
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise InputError(f"{path}: its gzip stream is damaged or cut off ({e})",
                             f"download it again, or keep what is readable: gunzip -c {path} > {path}.txt") from None
        except FileRefused as e:
            raise InputError(f"{path} {e}", e.fix) from None


# Byte-order marks of text that is not UTF-8, UTF-32's first: its little-endian mark starts with UTF-16's.
_OTHER_ENCODINGS = (("UTF-32", (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)),
                    ("UTF-16", (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)))


def read_records(path: Path, data: ChatData, invalid):
    """(where, record) for each JSON record of a data file: JSONL or one JSON array, gzipped or not.

    A line that is not UTF-8 or not JSON is passed to `invalid(where, detail, fix)` and skipped
    (it may raise); a cut-off JSON array sets `data.cut_bytes` and `data.cut_warning`.
    """
    with open_data(path) as f:
        head = f.read(4096)
        for encoding, boms in _OTHER_ENCODINGS:
            if head.startswith(boms):
                raise InputError(f"{path} is {encoding} text, not UTF-8",
                                 f"convert it: iconv -f {encoding} -t UTF-8 {path} > {path.stem}.utf8{path.suffix}")
        f.rewind()
        if head.lstrip(codecs.BOM_UTF8 + b" \t\r\n").startswith(b"["):
            yield from _json_array(path, f, data)
            return
        for lineno, raw in enumerate(f, 1):
            if lineno == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                invalid(where, f"not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line)",
                        "re-encode the file as UTF-8 or delete that line")
                continue
            try:
                record = jsonio.loads(line)
            except json.JSONDecodeError as e:
                invalid(where, f"malformed JSON ({e.msg} at column {e.colno})", "fix or delete that line")
                continue
            yield where, record


def read_conversations(path: Path, role_map: str | dict | None = None, strict: bool = False,
                       skip_invalid_lines: bool = False, require_assistant: bool = True) -> ChatData:
    """Parse chat JSONL (or one JSON array of records; either may be gzipped) as real dumps come.

    Conversations that cannot be trained on (empty, system-only, no assistant turn, a role
    neither `ROLES` nor `role_map` knows) are dropped and counted by reason; with `strict` the
    first one is an error naming its line. Lines that are not UTF-8 or not JSON fail, naming
    the line, unless `skip_invalid_lines` counts and skips them. A JSON array cut off at the
    end (ShareGPT dumps truncated by a download or an upload limit) yields every complete
    record and says how much was cut in `ChatData.cut_bytes` and `.cut_warning` (with
    `strict`, it is an error); an array malformed before its end is an error naming the line,
    column and record. Without `require_assistant` (decode prompts), conversations of user and
    system turns only are kept.
    """
    if not path.is_file():
        raise InputError(f"data file {path} does not exist", "pass --data a chat JSONL file")
    roles = {**ROLES, **parse_role_map(role_map)}
    data = ChatData([], [])

    def invalid(where: str, detail: str, fix: str) -> None:
        if not skip_invalid_lines:
            raise InputError(f"{where}: {detail}", f"{fix}, {SKIP_FIX}")
        data.invalid_lines += 1

    for where, record in read_records(path, data, invalid):
        try:
            messages = _normalize(record, roles, data, require_assistant)
        except _Invalid as e:
            invalid(where, e.detail, e.fix)
            continue
        except _Drop as e:
            data.records += 1
            record_drop(data.dropped, data.first_drop, e.reason, f"{where}: {e.detail}", strict)
            continue
        data.records += 1
        data.conversations.append(messages)
        data.where.append(where)
    if data.cut_warning and strict:
        raise InputError(data.cut_warning, "download the file again, or run without --strict "
                                           "to keep its complete records")
    if not data.records:
        skipped = f" ({data.invalid_lines} invalid lines skipped)" if data.invalid_lines else ""
        cut = f"; {data.cut_warning}" if data.cut_warning else ""
        raise InputError(f"data file {path} holds no conversations{skipped}{cut}", "pass a non-empty chat JSONL file")
    return data


# What json's decoder may have been reading when its input ran out, from the position its error
# names: part of a literal, a number's tail ("1." "1e+"), part of a \uXXXX escape (a high surrogate
# waits for its low half). A string cut short is an "Unterminated string" error; any other error
# is a mistake in the text.
_PARTIAL_TOKEN = re.compile(r"(t(r(ue?)?)?|f(a(l(se?)?)?)?|n(u(ll?)?)?|-|\.|[eE][-+]?"
                            r"|u[0-9a-fA-F]{0,4}(\\(u[0-9a-fA-F]{0,3})?)?)?")
_ARRAY_CHUNK = 1 << 24  # characters read at a time: memory holds a chunk plus the record being parsed
_SPACE_RUN = re.compile(r"[ \t\r\n]*")


def _ends_mid_value(text: str, e: json.JSONDecodeError) -> bool:
    """Whether decoding `text` failed only because it stops inside a value (more text may complete it)."""
    return e.msg.startswith("Unterminated string") or bool(_PARTIAL_TOKEN.fullmatch(text[e.pos:].strip()))


def _json_array(path: Path, f, data: ChatData):
    """The records of a file holding one JSON array (how some public dumps ship), with their places.

    Read incrementally (`raw_decode` over a buffer of `_ARRAY_CHUNK` characters), so a dump of
    GBs is never in memory whole. When the input ends inside the array, every complete record
    is yielded and `data.cut_bytes` / `data.cut_warning` say how much followed the last one;
    any other parse error raises, naming the line, column and record.
    """
    fix = "fix the file (a JSON array cannot skip lines), or convert it to JSONL"
    decoder, utf8 = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8-sig")()
    buf, pos, end, eof = "", 0, 0, False  # end: where the last complete record (or the space after it) ends in buf
    skipped = 0  # characters of space and separators after the last record, dropped from buf (ASCII: bytes too)
    line, col = 1, 0  # the line buf[0] is on, and the characters before it on that line
    partial = b""  # the bytes of a UTF-8 character the input ends inside

    def more() -> bool:
        """Append the next chunk to `buf`, dropping what precedes `end`; False at the end of the input."""
        nonlocal buf, pos, end, eof, line, col, partial
        if eof:
            return False
        raw = f.read(_ARRAY_CHUNK)
        if not raw:  # a character cut in half at the end is part of the cut, not an encoding error
            partial = utf8.getstate()[0]
        try:
            text = utf8.decode(raw) if raw else ""
        except UnicodeDecodeError as e:
            at = line + buf.count("\n") + raw[: e.start].count(b"\n")
            raise InputError(f"{path}:{at}: not UTF-8 (byte 0x{raw[e.start]:02x})",
                             "re-encode the file as UTF-8 (a JSON array cannot skip lines)") from None
        newlines = buf.count("\n", 0, end)
        col = end - buf.rfind("\n", 0, end) - 1 if newlines else col + end
        line += newlines
        buf, pos, end, eof = buf[end:] + text, pos - end, 0, not raw
        return True

    def skip_space() -> str:
        """The next non-space character, not consumed ('' at the end of the input).

        Space read to the end of `buf` is dropped before the next chunk comes (only space and
        separators lie between `end` and `pos` then), so a gap of GBs is never held.
        """
        nonlocal pos, end, skipped
        while True:
            pos = _SPACE_RUN.match(buf, pos).end()
            if pos < len(buf):
                return buf[pos]
            skipped, end = skipped + pos - end, pos
            if not more():
                return ""

    def line_at(at: int) -> int:
        return line + buf.count("\n", 0, at)

    def malformed(msg: str, at: int, where: str) -> InputError:
        lineno = line_at(at)
        column = at - buf.rfind("\n", 0, at) if lineno > line else col + at + 1
        return InputError(f"{path}:{lineno}: malformed JSON {where} ({msg} at column {column})", fix)

    if skip_space() != "[":
        raise InputError(f"{path} is not JSON lines nor a JSON array of conversations",
                         'write {"messages": [...]} per line')
    pos += 1
    n, closed = 0, skip_space() == "]"
    pos += closed
    while not closed and skip_space():
        try:
            record, stop = jsonio.raw_decode(decoder, buf, pos)
        except json.JSONDecodeError as e:
            if not _ends_mid_value(buf, e):
                raise malformed(e.msg, e.pos, f"in record {n + 1}") from None
            stop = None
        if stop is None or stop == len(buf):  # cut short, or a bare number that may go on: read more, decode again
            if len(buf) - pos > bounds.MAX_LINE_BYTES:
                raise InputError(f"{path}:{line_at(pos)}: record {n + 1} is over {bounds.MAX_LINE_BYTES} bytes "
                                 "(dspark.core.files.MAX_LINE_BYTES)", "split or delete that record")
            if more():
                continue
            if stop is None:
                break  # the input ends inside a record
        n, pos, end, skipped = n + 1, stop, stop, 0
        yield f"{path} record {n}", record
        sep = skip_space()
        if sep and sep not in ",]":
            raise malformed("Expecting ',' delimiter", pos, f"after record {n}")
        pos += bool(sep)
        closed = sep == "]"
    if not closed:
        data.cut_bytes = skipped + len(buf[end:].encode("utf-8")) + len(partial)
        data.cut_warning = (f"{path} ends inside its JSON array: {data.cut_bytes} bytes after record {n}, the last "
                            "complete one, were not read (a truncated download?)")
    elif skip_space():
        raise malformed("Extra data", pos, "after the array")


def record_drop(dropped: Counter, first: dict, reason: str, what: str, strict: bool) -> None:
    """Count a dropped conversation, or (strict) fail on it."""
    if strict:
        raise InputError(f"{what} [{reason}]", f"{_drop_fix(reason, strict)}, or run without --strict "
                                               "to drop and count such conversations")
    dropped[reason] += 1
    first.setdefault(reason, what)


def _drop_fix(reason: str, strict: bool = False) -> str:
    if reason.startswith("unknown_role:"):
        return f"map the role with --role-map '{reason.split(':', 1)[1]}=assistant' (or =user, =system)"
    if reason == "below_minimum_valid_tokens":
        return "lower --minimum-valid-tokens or raise --seq-length"
    if reason == OPENING_ASSISTANT_ONLY:
        return ("put the user turn that assistant turn answers before it (a conversation's opening assistant turn "
                "is context, never trained on)")
    if reason == "chat_template_error":
        return "fix that conversation, or use a model whose chat template accepts it"
    if reason == OVER_MAX_CHARS:
        return "split that conversation into shorter ones"
    if reason == "template_timeout":
        return "fix the chat template (a loop that does not end?), or use a model whose template renders in time"
    return "fix or delete that line" if strict else "pass conversations with a user and an assistant turn"


def _normalize(record, roles: dict, data: ChatData, require_assistant: bool = True) -> list[dict]:
    if not isinstance(record, dict):
        raise _Invalid("expected a JSON object", 'write {"messages": [...]} per line')
    if "messages" in record:
        turns, field_name = record["messages"], "messages"
    elif "conversations" in record:
        turns, field_name = record["conversations"], "conversations"
    else:
        raise _Invalid("no 'messages' (or ShareGPT 'conversations') field",
                       'write {"messages": [{"role": ..., "content": ...}]} per line')
    if turns is None or turns == []:
        raise _Drop("empty", "empty conversation (no turns)")
    if not isinstance(turns, list):
        raise _Invalid(f"'{field_name}' is not a list of turns", f"make '{field_name}' a list of turns")
    messages = []
    for i, turn in enumerate(turns):
        name = turn.get("role", turn.get("from")) if isinstance(turn, dict) else None
        if name is None:
            raise _Drop("malformed_turn", f"turn {i} is not an object with a 'role' (or 'from')")
        key = str(name).strip().lower()
        role = roles.get(key)
        if role is None:
            raise _Drop(f"unknown_role:{key[:40]}", f"turn {i} has unknown role {name!r}")
        if key != role:
            data.mapped_roles[f"{key}->{role}"] += 1
        messages.append({"role": role, "content": _text(turn["content"] if "content" in turn else turn.get("value"),
                                                        data.repaired)})
    if why := too_many_chars(m["content"] for m in messages):
        raise _Drop(OVER_MAX_CHARS, why)
    present = {m["role"] for m in messages}
    if not any(m["content"].strip() for m in messages):
        raise _Drop("empty", "empty conversation (every turn is blank)")
    if present == {"system"}:
        raise _Drop("system_only", "the conversation has only system turns")
    if "assistant" not in present and require_assistant:
        raise _Drop("no_assistant_turn", "the conversation has no assistant turn")
    return messages


def too_many_chars(texts) -> str | None:
    """Why `texts` (a conversation's or a prompt's) are too long to render and tokenize, or None."""
    chars = sum(map(len, texts))
    if chars > MAX_CONVERSATION_CHARS:
        return (f"{chars} characters, over the {MAX_CONVERSATION_CHARS} a conversation may hold "
                "(dspark.data.prepare.MAX_CONVERSATION_CHARS)")
    return None


def _text(content, repaired: Counter) -> str:
    """A turn's text: strings as they are, OpenAI content parts joined (non-text parts dropped)."""
    if content is None:
        repaired["null_content"] += 1
        return ""
    if isinstance(content, dict):
        content = [content]
    if isinstance(content, list):
        texts = [p if isinstance(p, str) else p.get("text") for p in content
                 if isinstance(p, str) or (isinstance(p, dict) and p.get("type", "text") == "text")]
        dropped = len(content) - sum(isinstance(t, str) for t in texts)
        if dropped:
            repaired["non_text_parts_dropped"] += dropped
        content = "\n".join(t for t in texts if isinstance(t, str))
    text = content if isinstance(content, str) else str(content)
    if _SURROGATES.search(text):  # "\ud83d" escapes of a split emoji: the tokenizer refuses them
        repaired["lone_surrogates"] += 1
        text = _SURROGATES.sub("\ufffd", text)
    return text


def supervised_turns(messages: list[dict]) -> list[int]:
    """The turns the loss mask covers: every assistant turn but one that opens the conversation.

    An assistant turn with nothing before it replies to a question the data does not hold (ShareGPT V3's
    conversations split into chunks: 6,358 of its 17,528 open so). Trained on, the drafter would learn to
    answer nothing, from the chat template's default system prompt alone; it stays in the sample as context
    of the later turns. speculators 0.9.0 does the same (its rows start at the conversation's second turn).
    An assistant turn after a system turn answers that turn, and is supervised.
    """
    return [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]


def tokenize_conversation(tokenizer, messages: list[dict], seq_length: int) -> tuple[list[int], list[int]]:
    """Token ids and the loss mask of the `supervised_turns`, truncated to `seq_length`."""
    def render(msgs, gen_prompt=False) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen_prompt)

    text = render(messages)
    spans = []
    for i in supervised_turns(messages):  # i > 0: the template's system prompt and header fall in `before`
        before, upto = render(messages[:i], gen_prompt=True), render(messages[: i + 1])
        if not (text.startswith(upto) and upto.startswith(before)):
            raise InputError("the chat template does not render conversations prefix-wise, so "
                             "assistant tokens cannot be located", "use a template whose turns append")
        spans.append((len(before), len(upto)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"][:seq_length], enc["offset_mapping"][:seq_length]
    mask = [int(any(s < e_span and e > s_span for s_span, e_span in spans)) for s, e in offsets]
    return ids, mask


_worker_tok = None


def _init_worker(model: str, trust_remote_code: bool):
    global _worker_tok
    _worker_tok = load_tokenizer(model, trust_remote_code)


class _TemplateTimeout(BaseException):
    """Rendering ran past its time limit (a BaseException: library code's `except Exception` must not swallow it)."""


@contextmanager
def _time_limit(seconds: float):
    """Raise `_TemplateTimeout` inside this block once `seconds` have passed.

    A SIGALRM timer: jinja renders in Python bytecode, which the handler interrupts wherever it loops.
    Signals reach the main thread only, so elsewhere (prepare called from a thread) there is no limit.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(_signum, _frame):
        raise _TemplateTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _tokenize_or_error(tokenizer, messages: list[dict], seq_length: int, timeout: float):
    """(ids, mask, None), or (None, None, (drop reason, why)) when the chat template refuses this
    conversation or takes over `timeout` seconds to render it."""
    from jinja2 import TemplateError

    try:
        with _time_limit(timeout):
            return (*tokenize_conversation(tokenizer, messages, seq_length), None)
    except _TemplateTimeout:
        return None, None, ("template_timeout", f"the chat template took over {timeout:g} s to render it")
    except TemplateError as e:  # e.g. "Conversation roles must alternate user/assistant/..."
        why = " ".join(str(e).split())[:200] or type(e).__name__
        return None, None, ("chat_template_error", f"the chat template refused it: {why}")


def _work(args):
    return _tokenize_or_error(_worker_tok, *args)


def prepare(cfg: PrepareConfig, progress: bool = True) -> dict:
    """Run (or skip, if up to date) the preparation; returns the summary."""
    out = Path(cfg.output)
    check_output("--output", out, folder=True, taken=[("--model", Path(cfg.model)), ("--data", Path(cfg.data))],
                 own=lambda p: written_files(p, PREPARED_FILES, "prepare.json"),
                 what="a folder `dspark prepare` wrote (prepare.json and its files, nothing else)")
    with output_lock("--output", out):  # a concurrent prepare into the same folder is refused
        return _prepare(cfg, out, progress)


def _prepare(cfg: PrepareConfig, out: Path, progress: bool) -> dict:
    from tqdm import tqdm

    model = Path(cfg.model)
    tok = load_tokenizer(model, cfg.trust_remote_code)
    data = read_conversations(Path(cfg.data), cfg.role_map, cfg.strict, cfg.skip_invalid_lines)
    convs, wheres = [], []
    for messages, where in zip(data.conversations, data.where):
        if supervised_turns(messages):
            convs.append(messages)
            wheres.append(where)
        else:
            record_drop(data.dropped, data.first_drop, OPENING_ASSISTANT_ONLY,
                        f"{where}: its only assistant turn opens it (a reply to a question the data does not hold)",
                        cfg.strict)
    if not convs:
        _all_dropped(cfg, data)
    key = {"format": PREPARE_FORMAT, "data": sha256_files([Path(cfg.data)]),
           "tokenizer": tokenizer_hash(model), "seq_length": cfg.seq_length,
           "minimum_valid_tokens": cfg.minimum_valid_tokens}
    if role_map := parse_role_map(cfg.role_map):  # only when given: keys of earlier runs stay valid
        key["role_map"] = role_map
    inputs_key = sha256_json(key)
    try:
        meta = PreparedData(out).meta  # opens a complete folder whose files are as prepare wrote them
    except InputError:
        meta = {}  # missing, damaged or edited: prepare again
    if (meta.get("inputs_key") == inputs_key and "stats" in meta and "files" in meta  # no record: write one
            and not (cfg.strict and meta["stats"].get("dropped"))):  # --strict: fail on those drops
        return {**meta["stats"], "up_to_date": True}

    workers = max(1, cfg.num_preprocessing_workers)
    jobs = [(m, cfg.seq_length, cfg.template_timeout) for m in convs]
    bar = tqdm(total=len(jobs), desc="prepare", unit="conv", disable=not progress)
    results = []

    def take(result) -> None:
        results.append(result)
        bar.update()
        if len(results) == TIMEOUTS_BEFORE_GIVING_UP and all(e and e[0] == "template_timeout" for *_, e in results):
            raise InputError(f"the chat template of {model} took over {cfg.template_timeout:g} s to render each of "
                             f"the first {len(results)} conversations", _drop_fix("template_timeout"))

    if workers == 1:
        for job in jobs:
            take(_tokenize_or_error(tok, *job))
    else:
        with get_context("spawn").Pool(workers, _init_worker, (str(model), cfg.trust_remote_code)) as pool:
            for r in pool.imap(_work, jobs, chunksize=16):  # imap keeps input order: deterministic
                take(r)
    bar.close()

    kept_ids, kept_mask = [], []
    freq: Counter = Counter()
    opening = 0  # kept conversations that open with an assistant turn: context, not supervised
    for (ids, mask, error), where, messages in zip(results, wheres, convs):
        if error is not None:
            reason, what = error
        elif (valid := sum(mask)) < cfg.minimum_valid_tokens:  # per conversation, not per turn (docs: prepare)
            reason, what = "below_minimum_valid_tokens", (
                f"{valid} supervised tokens within --seq-length {cfg.seq_length}, "
                f"fewer than --minimum-valid-tokens {cfg.minimum_valid_tokens}")
        else:
            kept_ids.append(ids)
            kept_mask.append(mask)
            freq.update(t for t, m in zip(ids, mask) if m)
            opening += messages[0]["role"] == "assistant"
            continue
        record_drop(data.dropped, data.first_drop, reason, f"{where}: {what}", cfg.strict)
    if not kept_ids:
        _all_dropped(cfg, data)

    input_ids = np.fromiter((t for s in kept_ids for t in s), dtype=np.int32)
    loss_mask = np.fromiter((m for s in kept_mask for m in s), dtype=np.uint8)
    offsets = np.zeros(len(kept_ids) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in kept_ids])
    stats = {"conversations": data.records, "kept": len(kept_ids), "dropped": sum(data.dropped.values()),
             "dropped_by_reason": dict(data.dropped.most_common()), "invalid_lines": data.invalid_lines,
             "tokens": int(len(input_ids)), "supervised_tokens": int(loss_mask.sum()),
             "unsupervised_turns": {"opening_assistant": opening} if opening else {},
             "truncated": sum(1 for ids, _, _ in results if ids is not None and len(ids) == cfg.seq_length),
             "mapped_roles": dict(sorted(data.mapped_roles.items())), "repaired": dict(sorted(data.repaired.items())),
             "cut_bytes": data.cut_bytes}
    if data.cut_warning:
        stats["warnings"] = [data.cut_warning]
    meta = {"format": PREPARE_FORMAT, "config": asdict(cfg), "inputs_key": inputs_key,
            "tokenizer_hash": tokenizer_hash(model), "fingerprint": data_fingerprint(input_ids, loss_mask, offsets),
            "vocab_size": len(tok), "stats": stats}
    _write_atomically(out, {"input_ids.npy": input_ids, "loss_mask.npy": loss_mask, "offsets.npy": offsets},
                      dict(freq), meta)
    return {**stats, "up_to_date": False}


def _all_dropped(cfg: PrepareConfig, data: ChatData):
    top = data.dropped.most_common()
    counts = ", ".join(f"{reason}: {n}" for reason, n in top[:3]) + (", ..." if len(top) > 3 else "")
    skipped = f"; {data.invalid_lines} invalid lines skipped" if data.invalid_lines else ""
    raise InputError(f"every conversation in {cfg.data} was dropped ({counts}{skipped}); "
                     f"first {top[0][0]}: {data.first_drop[top[0][0]]}", _drop_fix(top[0][0]))


def data_fingerprint(input_ids: np.ndarray, loss_mask: np.ndarray, offsets: np.ndarray) -> str:
    """The prepared data's identity, which stores and runs name: sha256 over the three arrays' bytes."""
    h = hashlib.sha256()
    for arr in (input_ids, loss_mask, offsets):
        h.update(memoryview(np.ascontiguousarray(arr)))  # memory-mapped arrays are read, not copied
    return h.hexdigest()


def _write_atomically(out: Path, arrays: dict, freq: dict, meta: dict) -> None:
    import torch

    from dspark.core.fsio import publishing, remove_leftovers

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out)  # of a prepare killed mid-way (its process is gone)
    with publishing(out, replace=True) as tmp:  # an earlier output is swapped out, then removed
        for name, arr in arrays.items():
            np.save(tmp / name, arr)
        torch.save(freq, tmp / "token_freq.pt")
        files = {name: {"bytes": (tmp / name).stat().st_size, "xxh3_128": file_xxh3(tmp / name)} for name in RECORDED_FILES}
        (tmp / "prepare.json").write_text(json.dumps({**meta, "files": files}, indent=2))


class PreparedData:
    """Read-only view of a prepared folder, checked on open.

    The arrays' dtypes, shapes, offsets (from 0, increasing, ending at the last token) and, against
    the record prepare.json keeps, each file's size and xxh3 (a folder prepared before the record:
    the sha256 fingerprint itself). A folder edited since `dspark prepare` wrote it is refused.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        meta_path = self.path / "prepare.json"
        if not meta_path.exists():
            raise InputError(f"{self.path} is not a prepared data folder (no prepare.json)",
                             "run `dspark prepare --output` on your chat data first")
        missing = [f for f in PREPARED_FILES if not (self.path / f).is_file()]
        if missing:
            raise InputError(f"prepared folder {self.path} lacks {', '.join(missing)}", self._rerun)
        try:
            self.meta = json.loads(meta_path.read_text())
            self.fingerprint: str = self.meta["fingerprint"]
            self.tokenizer_hash: str = self.meta["tokenizer_hash"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InputError(f"{meta_path} is unreadable or incomplete ({type(e).__name__}: {e})",
                             self._rerun) from None
        arrays = [self._load(name, mmap_mode="r") for name in ARRAYS]  # input_ids, loss_mask, offsets
        self._check_arrays(*arrays)
        self._check_files(*arrays)
        self.offsets = np.array(arrays[2])  # at most one per token (checked): memory as the tokens'

    @property
    def _rerun(self) -> str:
        return f"delete {self.path} and rerun `dspark prepare --output {self.path}` on its chat data"

    def _load(self, name: str, mmap_mode=None) -> np.ndarray:
        try:
            return np.load(self.path / name, mmap_mode=mmap_mode, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise InputError(f"{self.path / name} is unreadable ({' '.join(str(e).split())[:200]})",
                             self._rerun) from None

    def _refuse(self, name: str, what: str) -> InputError:
        return InputError(f"{self.path / name} {what}", self._rerun)

    def _check_arrays(self, input_ids: np.ndarray, loss_mask: np.ndarray, offsets: np.ndarray) -> None:
        """Dtypes, shapes and offsets, vectorised over the memory-mapped arrays (only offsets.npy is read)."""
        for (name, dtype), arr in zip(ARRAYS.items(), (input_ids, loss_mask, offsets)):
            if arr.dtype != dtype or arr.ndim != 1:
                raise self._refuse(name, f"holds {arr.dtype} of shape {list(arr.shape)}, not the 1-D "
                                         f"{np.dtype(dtype)} array prepare writes")
        tokens = len(input_ids)
        if len(loss_mask) != tokens:
            raise self._refuse("loss_mask.npy", f"holds {len(loss_mask)} entries for the {tokens} tokens of "
                                                "input_ids.npy")
        if len(offsets) < 2:
            raise self._refuse("offsets.npy", f"holds {len(offsets)} offsets: no sample")
        if len(offsets) > tokens + 1:
            raise self._refuse("offsets.npy", f"holds {len(offsets)} offsets for {tokens} tokens (a sample "
                                              "holds at least one)")
        if offsets[0] != 0:
            raise self._refuse("offsets.npy", f"starts at token {offsets[0]}, not 0")
        bad = np.flatnonzero(np.diff(offsets) <= 0)
        if bad.size:
            i = int(bad[0])
            raise self._refuse("offsets.npy", f"gives sample {i} the tokens [{offsets[i]}, {offsets[i + 1]}) (each "
                                              "sample starts where the one before ends and holds at least one token)")
        if offsets[-1] != tokens:
            raise self._refuse("offsets.npy", f"ends at token {offsets[-1]}, but input_ids.npy holds {tokens} tokens")

    def _check_files(self, input_ids: np.ndarray, loss_mask: np.ndarray, offsets: np.ndarray) -> None:
        """The files against prepare.json's record of them, so the fingerprint still names what they hold."""
        record = self.meta.get("files")
        if record is None:  # prepared before the record existed: the fingerprint itself (sha256, slower)
            if data_fingerprint(input_ids, loss_mask, offsets) != self.fingerprint:
                raise InputError(f"the files of {self.path} do not match its fingerprint (changed since prepare "
                                 "wrote them)", self._rerun)
            return
        for name in RECORDED_FILES:
            want = record.get(name) if isinstance(record, dict) else None
            path = self.path / name
            if (not isinstance(want, dict) or path.stat().st_size != want.get("bytes")  # the size first: no read
                    or file_xxh3(path) != want.get("xxh3_128")):
                raise self._refuse(name, "changed since prepare wrote it (its size or xxh3 differs from the record "
                                         "in prepare.json)")

    @cached_property
    def input_ids(self) -> np.ndarray:
        return self._load("input_ids.npy", mmap_mode="r")

    @cached_property
    def loss_mask(self) -> np.ndarray:
        return self._load("loss_mask.npy", mmap_mode="r")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def token_ids(self, i: int) -> np.ndarray:
        return self.sample(i)[0]

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        s, e = self.offsets[i], self.offsets[i + 1]
        return np.asarray(self.input_ids[s:e], dtype=np.int64), np.asarray(self.loss_mask[s:e])

    def token_freq(self) -> dict[int, int]:
        import torch

        return torch.load(self.path / "token_freq.pt", weights_only=True)
