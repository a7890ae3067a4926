"""A small OpenAI-compatible client for one server: its models, its /metrics, streamed requests timed.

Requests go only to the URL given: no proxy is asked (`*_proxy` variables are ignored) and a
redirect is an error, never followed. Each request streams, so the first token's arrival and the
gaps between later chunks are seen as a user sees them; the token count is the server's own
(`stream_options.include_usage`).
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from dspark.bench.metrics import Reading, read
from dspark.errors import DsparkError
from dspark.vllm_server import SERVER_INFO_PATH

NETWORK_ERRORS = (OSError, http.client.HTTPException)  # refused, reset, timed out, cut short, garbled


class BenchError(DsparkError):
    """A server that cannot be measured: unreachable, not vLLM, or failing mid-run."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, f"redirects to {newurl}: not followed", headers, fp)


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def _message(body) -> str | None:
    """The message of an OpenAI-style error body: `{"message": ...}` or `{"error": {"message": ...}}` (nested
    once more by newer vLLMs)."""
    if isinstance(body, dict):
        message = body.get("message")
        return message if isinstance(message, str) and message else _message(body.get("error"))
    return None


def _reason(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        try:
            message = _message(json.loads(e.read(2000).decode("utf-8", "replace")))
        except (OSError, ValueError):
            message = None
        return f"HTTP {e.code}" + (f": {str(message)[:300]}" if message else f" {e.reason}")
    if isinstance(e, urllib.error.URLError):
        return str(e.reason)
    if isinstance(e, (socket.timeout, TimeoutError)):
        return "timed out"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


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
    base: str        # scheme://host:port[/path], no trailing /v1
    timeout: float   # seconds any one read may wait

    @classmethod
    def at(cls, url: str, timeout: float, flag: str = "--endpoint") -> Server:
        parts = urllib.parse.urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BenchError(f"{flag} {url!r} is not an http(s) URL", "pass e.g. http://127.0.0.1:8000")
        try:
            parts.port  # noqa: B018  (raises on a port that is not a number)
        except ValueError:
            raise BenchError(f"{flag} {url!r} has a bad port", "pass e.g. http://127.0.0.1:8000") from None
        path = parts.path.rstrip("/").removesuffix("/v1")
        return cls(f"{parts.scheme}://{parts.netloc}{path}", timeout)

    def _get(self, path: str) -> bytes:
        with _OPENER.open(self.base + path, timeout=self.timeout) as reply:
            return reply.read()

    def models(self) -> list[dict]:
        """GET /v1/models: the served models (vLLM adds `max_model_len`)."""
        try:
            data = json.loads(self._get("/v1/models"))
        except NETWORK_ERRORS as e:
            raise BenchError(f"cannot reach {self.base}/v1/models: {_reason(e)}",
                             "start the server, or pass the URL it serves on") from None
        except ValueError:
            raise BenchError(f"{self.base}/v1/models did not answer JSON: not an OpenAI-compatible server",
                             "pass the URL of a vLLM server") from None
        models = data.get("data") if isinstance(data, dict) else None
        if not isinstance(models, list) or not models or not all(isinstance(m, dict) and "id" in m for m in models):
            raise BenchError(f"{self.base}/v1/models lists no model", "pass the URL of a vLLM server that serves one")
        return models

    def _answer(self, path: str, key: str) -> str | None:
        """`key` of GET path's JSON; None where the server does not answer it (not every server has the route)."""
        try:
            value = json.loads(self._get(path)).get(key)
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
        except urllib.error.HTTPError as e:
            raise BenchError(f"{self.base}/metrics answered {_reason(e)}: not a vLLM server",
                             "dspark bench reads vLLM's counters: point it at a vLLM server") from None
        except NETWORK_ERRORS as e:
            raise BenchError(f"cannot read {self.base}/metrics: {_reason(e)}",
                             "check that the server is up (its log), then rerun") from None
        if not reading.is_vllm:
            raise BenchError(f"{self.base}/metrics holds no vllm: metrics: not a vLLM server",
                             "dspark bench reads vLLM's counters: point it at a vLLM server")
        return reading

    def stream(self, route: str, payload: dict) -> Result:
        """POST one streamed request and time it; failures come back as a Result, never raised."""
        body = json.dumps({**payload, "stream": True, "stream_options": {"include_usage": True}}).encode()
        request = urllib.request.Request(self.base + route, data=body, headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        out, last = Result(ok=False), None
        try:
            with _OPENER.open(request, timeout=self.timeout) as reply:
                for raw in reply:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        out.ok = True
                        break
                    chunk = json.loads(data)
                    if not isinstance(chunk, dict):
                        raise ValueError(f"a streamed chunk is not a JSON object: {data[:100]!r}")
                    if "error" in chunk:  # vLLM reports a failure mid-stream this way, then still sends [DONE]
                        out.error = f"the server reported: {_message(chunk) or str(chunk['error'])[:300]}"
                        break
                    if chunk.get("usage"):
                        out.tokens = int(chunk["usage"].get("completion_tokens") or 0)
                    if any(c.get("text") or (c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
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
