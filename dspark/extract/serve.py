"""`dspark serve`: an OpenAI-compatible completions server on the transformers engine.

It answers hidden-state extraction requests exactly as vLLM with our KV
connector does (both plan each request with the connector's `Producer`):
POST /v1/completions with `prompt` = token ids, `max_tokens` 1, `return_token_ids`
and `kv_transfer_params` (`sample_id`, `prepared_fingerprint`); the reply carries
`choices[0].prompt_token_ids` and the transfer params (`handle` = the Mooncake key).
The states are durable in every sink before the reply, so a reader that waits for
the handle never waits long. A failed extraction publishes an error marker on the
handle, so the reader fails at once.

A bad client gets an answer and a bounded wait, never a hung thread (`ServeLimits`):
- a prompt longer than `max_model_len` (default: the verifier's `max_position_embeddings`)
  is a 400 that never reaches the forward lock; token ids are ints, not booleans or floats;
- the body is a JSON object with a true Content-Length: a missing one is a 411, a bad one (or
  one beside a Transfer-Encoding) a 400, one past `max_body_bytes` a 413, one that never arrives a 408;
- a connection has `client_timeout` seconds in all to send its request (one byte at a time
  does not stretch it), then gets a 408 and is closed; replies are written under the same
  timeout. One request per connection (HTTP/1.0), so that is also the time per request;
- at most `max_connections` connections are served at once, one thread each; the accepting
  thread answers the next ones 503 at once instead of starting a thread.
"""

from __future__ import annotations

import io
import json
import socket
import sys
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch

from dspark.extract.config import ServeLimits
from dspark.connector.base import Sample
from dspark.connector.producer import Producer
from dspark.core.errors import DsparkError, InputError


class ExtractionService:
    def __init__(self, engine, producer: Producer, model_name: str, limits: ServeLimits = ServeLimits()):
        self.engine, self.producer, self.model_name, self.limits = engine, producer, model_name, limits
        config = getattr(engine.model.config, "text_config", engine.model.config)
        self.vocab = config.vocab_size
        model_max = getattr(config, "max_position_embeddings", None)
        if limits.max_model_len is None and model_max is None:
            raise InputError("the verifier's config has no max_position_embeddings", "pass --max-model-len")
        if limits.max_model_len is not None and model_max is not None and limits.max_model_len > model_max:
            raise InputError(f"--max-model-len {limits.max_model_len} is more than the verifier's maximum length "
                             f"{model_max} (max_position_embeddings): positions past it were never trained",
                             f"pass --max-model-len {model_max} or less, or leave it out")
        self.max_model_len: int = limits.max_model_len or model_max
        # Token ids take at most 32 bytes of JSON each, whatever the spacing; 1 MiB is room for the rest.
        self.max_body_bytes = (1 << 20) + 32 * self.max_model_len
        self._lock = threading.Lock()  # one forward at a time: the engine is not re-entrant
        self.requests = 0

    def complete(self, body) -> tuple[int, dict]:
        """(HTTP status, reply) for one parsed request body; every check runs before the forward lock."""
        if not isinstance(body, dict):
            return 400, _error(f"the request body must be a JSON object, got {type(body).__name__}")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if not (isinstance(prompt, list) and prompt):
            return 400, _error("prompt must be a non-empty list of token ids")
        if len(prompt) > self.max_model_len:
            return 400, _error(f"the prompt has {len(prompt)} tokens, more than this server's maximum length "
                               f"{self.max_model_len} (--max-model-len)")
        if not all(type(t) is int and 0 <= t < self.vocab for t in prompt):  # type(): a bool is an int too
            return 400, _error(f"prompt must be a list of integer token ids in [0, {self.vocab})")
        request_id = uuid.uuid4().hex
        try:
            planned = self.producer.plan(request_id, body.get("kv_transfer_params"), len(prompt))
        except DsparkError as e:
            return 400, _error(str(e))
        self.requests += 1
        sink = self.producer.sink(planned.prepared_fingerprint)
        try:
            with self._lock:
                hidden = self.engine.extract([np.asarray(prompt, dtype=np.int64)])[0]
                next_token = self._next_token(hidden)
            sample = Sample(-1 if planned.sample_id is None else int(planned.sample_id),
                            np.asarray(prompt, dtype=np.int64), hidden, handle=planned.handle)
            sink.write(sample)  # a request means "produce it": a live object is replaced, a stored one kept
            sink.flush()  # durable (and visible) before the reply
        except Exception as e:  # publish the failure where the reader is waiting, then report it
            try:
                sink.write_error(planned.handle, f"{type(e).__name__}: {e}")
            except Exception:
                pass
            return 500, _error(f"extraction failed: {type(e).__name__}: {e}", "server_error")
        return 200, {
            "id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "text": "", "finish_reason": "length", "logprobs": None,
                         "prompt_token_ids": prompt, "token_ids": [next_token]}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1, "total_tokens": len(prompt) + 1},
            "kv_transfer_params": planned.transfer,
        }

    @torch.inference_mode()
    def _next_token(self, hidden: torch.Tensor) -> int:
        """max_tokens=1: the greedy next token from the last layer (pre-norm) through norm + lm_head."""
        m = self.engine.model
        last = hidden[-1, -1].to(self.engine.device, self.engine.dtype)
        return int(m.lm_head(m.model.norm(last[None]))[0].argmax())


def _error(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind}}


def _raw_reply(code: int, obj: dict) -> bytes:
    """A whole reply as bytes, for where no parsed request is at hand (a busy server, a request that never came)."""
    data = json.dumps(obj).encode()
    return (f"HTTP/1.0 {code} {HTTPStatus(code).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data


LINGER_BYTES = 64 << 20  # the most of a refused body read and dropped so the client sees the refusal


class _DeadlineReader(io.RawIOBase):
    """A connection's socket, read against one deadline for its whole request.

    A timeout per read alone would let a client that sends a byte every few seconds hold its
    thread forever; here each read waits at most for what is left of the client's time.
    """

    def __init__(self, sock: socket.socket, seconds: float):
        self.sock, self.deadline, self.expired = sock, time.monotonic() + seconds, False

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        left = self.deadline - time.monotonic()
        if left > 0:
            self.sock.settimeout(left)
            try:
                return self.sock.recv_into(buf)
            except TimeoutError:
                pass
        self.expired = True
        raise TimeoutError("the client did not send its request in time")


class _BoundedServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with at most `max_connections` handler threads; the next connections get a 503."""

    request_queue_size = 128  # listen backlog: a burst of connects waits for accept() instead of retrying SYNs

    def __init__(self, address, handler, max_connections: int):
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            return self._refuse_busy(request)
        try:
            super().process_request(request, client_address)  # starts the thread that releases the slot
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse_busy(self, request) -> None:
        """Runs on the accepting thread: a reply this small fits a new socket's send buffer, so it never waits."""
        try:
            request.settimeout(1.0)
            request.sendall(_raw_reply(503, _error(
                f"this server is serving its {self.max_connections} connections (--max-connections)",
                "server_busy")))
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that went away is not our error
            super().handle_error(request, client_address)


def make_server(service: ExtractionService, host: str, port: int) -> ThreadingHTTPServer:
    limits = service.limits

    class Handler(BaseHTTPRequestHandler):
        timeout = limits.client_timeout  # StreamRequestHandler sets it on the socket; reads use _DeadlineReader

        def setup(self):
            super().setup()
            self.rfile.close()
            self._reader = _DeadlineReader(self.connection, self.timeout)
            self.rfile = io.BufferedReader(self._reader)
            self._replied = False

        def handle(self):
            super().handle()  # a request line or headers that time out are dropped there without a word
            if self._reader.expired and not self._replied:
                try:
                    self.connection.settimeout(self.timeout)
                    self.wfile.write(_raw_reply(408, _error(f"no whole request within {self.timeout:g} s")))
                except OSError:
                    pass

        def _send(self, code: int, obj: dict) -> None:
            self.connection.settimeout(self.timeout)  # reading may have left less: a reply gets the full time
            data = json.dumps(obj).encode()
            self._replied = True
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if code >= 400:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def _refuse(self, code: int, message: str) -> None:
            """An error reply before the body was read; then the body is read (in the client's time) and dropped.

            Closing a socket with unread data resets the connection, and a client still sending
            its body would see the reset instead of the reply.
            """
            self._send(code, _error(message))
            self.wfile.flush()
            try:
                self.connection.shutdown(socket.SHUT_WR)
                dropped = 0
                while dropped < LINGER_BYTES and (chunk := self.rfile.read1(1 << 16)):
                    dropped += len(chunk)
            except OSError:  # the client's time ran out, or it went away
                pass

        def do_GET(self):  # noqa: N802
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": service.model_name, "object": "model",
                                                             "owned_by": "dspark"}]})
            else:
                self._send(404, _error(f"no route {self.path}"))

        def do_POST(self):  # noqa: N802
            if self.path != "/v1/completions":
                return self._refuse(404, f"no route {self.path}")
            lengths = self.headers.get_all("Content-Length") or []
            if lengths and self.headers.get("Transfer-Encoding") is not None:
                # A proxy in front may frame the body by the one and this server by the other (request
                # smuggling); HTTP/1.1 (RFC 9112 6.1) lets a server refuse the pair, and we do.
                return self._refuse(400, "the request has both Transfer-Encoding and Content-Length; send only "
                                         "a Content-Length")
            if not lengths:
                return self._refuse(411, "send a Content-Length header (chunked bodies are not read)")
            length = lengths[0].strip()
            if len(set(lengths)) > 1 or not (length.isascii() and length.isdigit()):
                return self._refuse(400, f"Content-Length {', '.join(lengths)!r:.60} is not one byte count")
            length = int(length)
            if length > service.max_body_bytes:
                return self._refuse(413, f"the request body is {length} bytes, more than the {service.max_body_bytes} "
                                         f"this server reads (prompts of at most {service.max_model_len} tokens, "
                                         f"--max-model-len)")
            try:
                raw = self.rfile.read(length)
            except TimeoutError:
                return self._send(408, _error(f"the {length}-byte body (Content-Length) did not arrive within "
                                              f"{self.timeout:g} s"))
            if len(raw) < length:
                return self._send(400, _error(f"the body ended after {len(raw)} of the {length} bytes its "
                                              f"Content-Length announced"))
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):  # not JSON, not UTF-8, an integer too long, nested too deep
                return self._send(400, _error("request body is not JSON"))
            try:
                reply = service.complete(body)
            except Exception as e:  # a bug must still answer, not drop the connection
                reply = 500, _error(f"{type(e).__name__}: {e}", "server_error")
            self._send(*reply)

        def log_message(self, *args):  # requests are counted, not printed one by one
            pass

    return _BoundedServer((host, port), Handler, limits.max_connections)
