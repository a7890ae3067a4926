"""`dspark serve`: an OpenAI-compatible completions server on the transformers engine.

It answers hidden-state extraction requests exactly as vLLM with our KV
connector does: POST /v1/completions with `prompt` = token ids, `max_tokens`
1, `return_token_ids` and `kv_transfer_params`; the reply carries
`choices[0].prompt_token_ids` and the transfer manifest in
`kv_transfer_params` (`handle` = the Mooncake key). The states go to the
configured sinks before the reply, so a reader that waits for the handle never
waits long. A failed extraction publishes an error marker on the handle, so the
reader fails at once. Pass `kv_transfer_params: {"sample_id": N}` to key the
sample by its prepared-data id (required for the Zarr sink).
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
from dspark.connector.mooncake import MooncakeSink


class ExtractionService:
    def __init__(self, engine, sinks: list, model_name: str):
        self.engine, self.sinks, self.model_name = engine, sinks, model_name
        self.mooncake = next((s for s in sinks if isinstance(s, MooncakeSink)), None)
        self.vocab = engine.model.config.vocab_size
        self._lock = threading.Lock()  # one forward at a time: the engine is not re-entrant
        self.requests = 0

    def complete(self, body: dict) -> tuple[int, dict]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t < self.vocab for t in prompt)):
            return 400, _error(f"prompt must be a non-empty list of token ids in [0, {self.vocab})")
        params = body.get("kv_transfer_params") or {}
        sample_id = params.get("sample_id")
        if sample_id is None and len(self.sinks) > (1 if self.mooncake else 0):
            return 400, _error("kv_transfer_params.sample_id is required when writing to a Zarr store")
        key = self.mooncake.key(sample_id) if (self.mooncake and sample_id is not None) else f"dspark/req/{uuid.uuid4().hex}"
        self.requests += 1
        try:
            with self._lock:
                hidden = self.engine.extract([np.asarray(prompt, dtype=np.int64)])[0]
                next_token = self._next_token(hidden)
            sample = Sample(-1 if sample_id is None else int(sample_id), np.asarray(prompt, dtype=np.int64), hidden)
            transfer = None
            for sink in self.sinks:
                if isinstance(sink, MooncakeSink):
                    transfer = sink.write(sample, key)
                elif not sink.has(sample.sample_id):
                    sink.write(sample)
                    sink.flush()
        except Exception as e:  # publish the failure where the reader is waiting, then report it
            if self.mooncake:
                try:
                    self.mooncake.write_error(key, f"{type(e).__name__}: {e}")
                except Exception:
                    pass
            return 500, _error(f"extraction failed: {type(e).__name__}: {e}", "server_error")
        return 200, {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "text": "", "finish_reason": "length", "logprobs": None,
                         "prompt_token_ids": prompt, "token_ids": [next_token]}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1, "total_tokens": len(prompt) + 1},
            "kv_transfer_params": transfer or {"handle": key, "sample_id": sample_id},
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
