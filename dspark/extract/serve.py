"""`dspark serve`: an OpenAI-compatible completions server on the transformers engine.

It answers hidden-state extraction requests exactly as vLLM with our KV
connector does (both plan each request with the connector's `Producer`):
POST /v1/completions with `prompt` = token ids, `max_tokens` 1, `return_token_ids`
and `kv_transfer_params` (`sample_id`, `prepared_fingerprint`); the reply carries
`choices[0].prompt_token_ids` and the transfer params (`handle` = the Mooncake key).
The states are durable in every sink before the reply, so a reader that waits for
the handle never waits long. A failed extraction publishes an error marker on the
handle, so the reader fails at once.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch

from dspark.connector.base import Sample
from dspark.connector.producer import Producer
from dspark.errors import DsparkError


class ExtractionService:
    def __init__(self, engine, producer: Producer, model_name: str):
        self.engine, self.producer, self.model_name = engine, producer, model_name
        self.vocab = engine.model.config.vocab_size
        self._lock = threading.Lock()  # one forward at a time: the engine is not re-entrant
        self.requests = 0

    def complete(self, body: dict) -> tuple[int, dict]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t < self.vocab for t in prompt)):
            return 400, _error(f"prompt must be a non-empty list of token ids in [0, {self.vocab})")
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


def make_server(service: ExtractionService, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

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
                return self._send(404, _error(f"no route {self.path}"))
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            except json.JSONDecodeError:
                return self._send(400, _error("request body is not JSON"))
            self._send(*service.complete(body))

        def log_message(self, *args):  # requests are counted, not printed one by one
            pass

    return ThreadingHTTPServer((host, port), Handler)
