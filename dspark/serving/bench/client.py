"""A small OpenAI-compatible client for one server: its models, its /metrics, streamed requests timed.

Requests go only to the URL given (http.client: no proxy is asked, a redirect is an error, never
followed); user info in the URL is sent as Basic credentials and shown only as `user:***@`. Each
request streams, so the first token's arrival and the gaps between later chunks are seen as a user
sees them; the token count is the server's own (`stream_options.include_usage`).

Every read is bounded (docs/reliability.md, Read bounds): a body at most MAX_BODY bytes, a streamed line at
most MAX_LINE, JSON as deep as jsonio.MAX_JSON_DEPTH; each read waits at most
--request-timeout for data, and each request has a total deadline besides (a GET --request-timeout,
a streamed request --max-seconds), so a server that trickles a byte now and then cannot hold the
bench forever.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import socket
import threading
import time
import urllib.parse
from contextlib import contextmanager
from dataclasses import dataclass, field

from dspark.serving.bench.metrics import Reading, count, read
from dspark.core.errors import DsparkError
from dspark.core.jsonio import loads
from dspark.vllm_server import SERVER_INFO_PATH

MAX_BODY = 16 << 20  # bytes of one GET's body (/v1/models, /metrics, /version): a large vLLM's /metrics is ~1 MB
MAX_LINE = 1 << 20   # bytes of one streamed line: a chunk carries the few tokens of one verifier step

NETWORK_ERRORS = (OSError, http.client.HTTPException)  # refused, reset, timed out, cut short, garbled
_PASSWORD = re.compile(r"(//[^/?#]*?:)[^/?#]*@")  # the password of scheme://user:password@host (the last @)


class BenchError(DsparkError):
    """A server that cannot be measured: unreachable, not vLLM, or failing mid-run."""


class _Status(http.client.HTTPException):
    """A reply other than 200: its code and the server's own message, if it gave one."""

    def __init__(self, reply: http.client.HTTPResponse):
        try:
            message = _message(loads(reply.read(2000)))
        except (*NETWORK_ERRORS, ValueError):
            message = None
        where = reply.getheader("Location")
        super().__init__(f"HTTP {reply.status}" + (
            f": {str(message)[:300]}" if message else f" {reply.reason}") + (
            f" (redirects to {redact(where)[:300]}: not followed)" if 300 <= reply.status < 400 and where else ""))


class _Late(TimeoutError):
    """A request past its total deadline."""


def redact(url: str) -> str:
    """`url` with the password of its user info shown as ***: what bench prints and records."""
    return _PASSWORD.sub(r"\1***@", url)


def _message(body) -> str | None:
    """The message of an OpenAI-style error body: `{"message": ...}` or `{"error": {"message": ...}}` (nested
    once more by newer vLLMs)."""
    if isinstance(body, dict):
        message = body.get("message")
        return message if isinstance(message, str) and message else _message(body.get("error"))
    return None


def _reason(e: BaseException) -> str:
    if isinstance(e, json.JSONDecodeError):
        return f"not JSON ({e})"
    if isinstance(e, (_Late, _Status, ValueError)):
        return str(e)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _content(chunk: dict) -> bool:
    """Whether a streamed chunk carries generated text; a chunk of another shape is a ValueError."""
    choices = chunk.get("choices") or []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise ValueError("a streamed chunk's choices is not a list of objects")
    for c in choices:
        delta = c.get("delta") or {}
        if not isinstance(delta, dict):
            raise ValueError("a streamed chunk's choices[].delta is not an object")
        if c.get("text") or delta.get("content"):
            return True
    return False


@dataclass
class Result:
    """One streamed request as its client saw it (seconds)."""

    ok: bool
    latency: float = 0.0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)  # between content chunks after the first
    tokens: int = 0
    error: str = ""


@dataclass(frozen=True)
class Server:
    base: str        # scheme://host:port[/path], no trailing /v1, the password as ***: what is shown
    timeout: float   # seconds any one read may wait, and a GET may take in all (--request-timeout)
    longest: float   # seconds a streamed request may take in all (--max-seconds)
    host: str = ""
    port: int | None = None
    https: bool = False
    path: str = ""
    auth: str | None = field(default=None, repr=False)  # Basic credentials from the URL's user info

    @classmethod
    def at(cls, url: str, timeout: float, longest: float, flag: str = "--endpoint") -> Server:
        fix = "pass e.g. http://127.0.0.1:8000"
        try:
            parts = urllib.parse.urlsplit(url.strip())
            parts.port  # noqa: B018  (raises on a port that is not a number)
        except ValueError as e:
            raise BenchError(f"{flag} {redact(url)!r} is not a URL ({e})", fix) from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BenchError(f"{flag} {redact(url)!r} is not an http(s) URL", fix)
        auth = None
        if parts.username is not None:
            user = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
            auth = "Basic " + base64.b64encode(user.encode()).decode()
        path = parts.path.rstrip("/").removesuffix("/v1")
        return cls(redact(f"{parts.scheme}://{parts.netloc}{path}"), timeout, longest, parts.hostname, parts.port,
                   parts.scheme == "https", path, auth)

    @contextmanager
    def _exchange(self, method: str, route: str, seconds: float, bound: str, body: bytes | None = None):
        """One request; yields its reply (status 200) and an Event set once past the deadline. Each read waits at
        most `timeout` for data and the whole exchange at most `seconds` (`bound` names the flag): then a timer
        shuts the socket, so a read blocked in this thread ends too, and a server that trickles a byte at a time
        is cut off like a silent one."""
        kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = kind(self.host, self.port or (443 if self.https else 80), timeout=self.timeout)
        late, held = threading.Event(), []  # held: the socket, which http.client forgets once a reply will close

        def cut():
            late.set()
            for sock in held:
                try:
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain socket's: TLS state is left alone
                except OSError:
                    pass

        timer = threading.Timer(seconds, cut)
        timer.daemon = True
        timer.start()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if self.auth:
            headers["Authorization"] = self.auth
        reply = None
        try:
            conn.connect()
            held.append(conn.sock)
            if late.is_set():  # the deadline passed while connecting, before there was a socket to shut
                raise _Late()
            conn.request(method, self.path + route, body=body, headers=headers)
            reply = conn.getresponse()
            if reply.status != 200:
                raise _Status(reply)
            yield reply, late
            if late.is_set():  # the shut socket read as the end of the reply: it is cut short
                raise _Late()
        except (*NETWORK_ERRORS, ValueError) as e:  # a line cut short by the deadline is not JSON either
            if late.is_set():
                raise _Late(f"not done within {seconds:g} s ({bound})") from None
            if isinstance(e, (socket.timeout, TimeoutError)):
                raise _Late(f"no data for {self.timeout:g} s (--request-timeout)") from None
            raise
        finally:
            timer.cancel()
            if reply is not None:  # a reply that will close holds the socket after the connection let it go
                reply.close()
            conn.close()

    def _get(self, route: str) -> bytes:
        with self._exchange("GET", route, self.timeout, "--request-timeout") as (reply, _):
            data = reply.read(MAX_BODY + 1)
        if len(data) > MAX_BODY:
            raise BenchError(f"{self.base}{route} answered more than {MAX_BODY} bytes (dspark bench's bound on "
                             "one body): not a vLLM server", "point --endpoint at a vLLM server")
        return data

    def models(self) -> list[dict]:
        """GET /v1/models: the served models (vLLM adds `max_model_len`)."""
        try:
            data = loads(self._get("/v1/models"))
        except NETWORK_ERRORS as e:
            raise BenchError(f"cannot reach {self.base}/v1/models: {_reason(e)}",
                             "start the server, or pass the URL it serves on") from None
        except ValueError as e:
            raise BenchError(f"{self.base}/v1/models did not answer JSON ({e}): not an OpenAI-compatible server",
                             "pass the URL of a vLLM server") from None
        models = data.get("data") if isinstance(data, dict) else None
        if not isinstance(models, list) or not models or not all(
                isinstance(m, dict) and isinstance(m.get("id"), str) for m in models):
            raise BenchError(f"{self.base}/v1/models lists no model", "pass the URL of a vLLM server that serves one")
        return models

    def _answer(self, route: str, key: str) -> str | None:
        """`key` of GET route's JSON; None where the server does not answer it (not every server has the route)."""
        try:
            value = loads(self._get(route)).get(key)
        except (*NETWORK_ERRORS, ValueError, AttributeError):
            return None
        return value if isinstance(value, str) else None

    def runtime(self) -> dict:
        """The server's vLLM version (GET /version) and model runner (GET /dspark/server, which `dspark serve-draft`
        adds to vLLM): what the server itself reports, None where it does not."""
        return {"vllm_version": self._answer("/version", "version"),
                "vllm_model_runner": self._answer(SERVER_INFO_PATH, "vllm_model_runner")}

    def metrics(self) -> Reading:
        """GET /metrics; a server without it, or without vLLM's metrics in it, is not one we can read."""
        try:
            reading = read(self._get("/metrics").decode("utf-8", "replace"))
        except _Status as e:
            raise BenchError(f"{self.base}/metrics answered {e}: not a vLLM server",
                             "dspark bench reads vLLM's counters: point it at a vLLM server") from None
        except NETWORK_ERRORS as e:
            raise BenchError(f"cannot read {self.base}/metrics: {_reason(e)}",
                             "check that the server is up (its log), then rerun") from None
        except ValueError as e:  # a count that is no count: nothing read from this server can be trusted
            raise BenchError(f"{self.base}/metrics: {e}",
                             "check the server: a vLLM server never reports this") from None
        if not reading.is_vllm:
            raise BenchError(f"{self.base}/metrics holds no vllm: metrics: not a vLLM server",
                             "dspark bench reads vLLM's counters: point it at a vLLM server")
        return reading

    def stream(self, route: str, payload: dict) -> Result:
        """POST one streamed request and time it; failures come back as a Result, never raised."""
        body = json.dumps({**payload, "stream": True, "stream_options": {"include_usage": True}}).encode()
        start = time.perf_counter()
        out, last = Result(ok=False), None
        try:
            with self._exchange("POST", route, self.longest, "--max-seconds", body) as (reply, late):
                while not late.is_set() and (raw := reply.readline(MAX_LINE + 1)):
                    if len(raw) > MAX_LINE:
                        raise ValueError(f"a streamed line is longer than {MAX_LINE} bytes (dspark bench's bound)")
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        out.ok = True
                        break
                    chunk = loads(data)
                    if not isinstance(chunk, dict):
                        raise ValueError(f"a streamed chunk is not a JSON object: {data[:100]!r}")
                    if "error" in chunk:  # vLLM reports a failure mid-stream this way, then still sends [DONE]
                        out.error = f"the server reported: {_message(chunk) or str(chunk['error'])[:300]}"
                        break
                    usage = chunk.get("usage")
                    if usage is not None and not isinstance(usage, dict):
                        raise ValueError("a streamed chunk's usage is not an object")
                    if usage:
                        out.tokens = count(usage.get("completion_tokens") or 0, "usage.completion_tokens")
                    if _content(chunk):
                        now = time.perf_counter()
                        if last is None:
                            out.ttft = now - start
                        else:
                            out.gaps.append(now - last)
                        last = now
            if not out.ok and not out.error:
                out.error = "the stream ended without [DONE]"
        except (*NETWORK_ERRORS, ValueError) as e:
            out.ok, out.error = False, _reason(e)
        out.latency = time.perf_counter() - start
        return out
