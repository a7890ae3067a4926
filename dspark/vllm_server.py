"""A vLLM server as a child process: its environment, its /health wait, and a stop that takes its whole
process group (vLLM's engine-core processes live there too). Shared by the extraction launcher
(`dspark launch-vllm`) and the drafter server (`dspark serve-draft`); vLLM itself is never imported
here: it runs in the interpreter the command names.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from dspark.core.errors import DsparkError, InputError
from dspark.verifier.hub import local_model


RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"  # vLLM's switch between its model runners V1 and V2 (vllm/envs.py)
SERVER_INFO_PATH = "/dspark/server"
SERVER_INFO_MIDDLEWARE = "dspark.vllm_server.server_info"  # vLLM's --middleware takes an import path


async def server_info(request, call_next):
    """An HTTP middleware vLLM loads into its API server (`--middleware`): GET /dspark/server answers the model
    runner the server's own config chose (`vllm_config.use_v2_model_runner`, decided in each of its processes
    from the same environment), which vLLM reports nowhere else outside its development mode."""
    if request.method == "GET" and request.url.path == SERVER_INFO_PATH:
        from starlette.responses import JSONResponse  # vLLM's web framework, there in the server's interpreter

        v2 = request.app.state.vllm_config.use_v2_model_runner
        return JSONResponse({"vllm_model_runner": "v2" if v2 else "v1"})
    return await call_next(request)


class LaunchError(DsparkError):
    """The server did not come up."""


class ServerExited(LaunchError):
    """The server exited before it was ready; the launcher exits with the server's status."""

    def __init__(self, returncode: int):
        super().__init__(f"vLLM exited with status {returncode} before it was ready", "read its log above")
        self.exit_code = exit_status(returncode)


def cpu_env() -> dict[str, str]:
    """vLLM on CPU refuses to start without a KV-cache budget (GiB); a GPU build needs nothing."""
    if "VLLM_CPU_KVCACHE_SPACE" in os.environ:
        return {}
    import torch

    return {} if torch.cuda.is_available() else {"VLLM_CPU_KVCACHE_SPACE": "1"}


def offline_env(model: str, revision: str | None) -> dict[str, str]:
    """A hub id the Hugging Face cache holds is served from the cache, as its config.json was read: vLLM
    asks the hub first otherwise, and with no network fails to start although every file is here.
    (Not for one found only in --download-dir: vLLM's offline lookup reads only the Hugging Face cache.)"""
    if "HF_HUB_OFFLINE" in os.environ or Path(model).expanduser().is_dir():
        return {}
    try:
        local_model(model, revision=revision)
    except InputError:
        return {}  # not cached: vLLM downloads it
    return {"HF_HUB_OFFLINE": "1"}


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it (killed by signal N: 128 + N)."""
    return returncode if returncode >= 0 else 128 - returncode


def flag_name(word: str) -> str:
    """A word as vLLM's parser names the flag: `--max_model_len=8` is `--max-model-len`."""
    return word.split("=")[0].replace("_", "-")


def owned_flags(vllm_flags: list[str], owned: set[str]) -> list[str]:
    """Those of vLLM's flags that the caller sets itself: a second copy would silently win in vLLM's parser."""
    return sorted({flag_name(word) for word in vllm_flags} & owned)


def require_free(url: str) -> None:
    """Refuse a /health URL whose port something already listens on: that server would answer for the one
    we start, which then fails to bind while we report it ready. (Other bind errors are vLLM's to report.)"""
    import errno
    import socket
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname, parts.port
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to vLLM too
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise InputError(f"port {port} on {host} is in use ({e.strerror})",
                                 "stop what listens there, or pass another --port") from None


def health_url(host: str | None, port: int) -> str:
    # A wildcard bind (or vLLM's default, None: every interface) answers on loopback.
    host = {None: "127.0.0.1", "": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, interval: float = 0.25) -> None:
    """Return once GET url/health answers 200; raise if the server exits first or `timeout` passes."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never ask a proxy about loopback
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        with contextlib.suppress(OSError):  # refused, reset, HTTP errors, slow replies: not up yet
            with opener.open(f"{url}/health", timeout=max(interval, 1.0)) as reply:
                if reply.status == 200:
                    return
        if time.monotonic() > deadline:
            raise LaunchError(f"vLLM was not healthy at {url}/health after {timeout:g}s",
                              "raise --health-timeout, or read its log above")
        time.sleep(interval)
    raise ServerExited(proc.returncode)


def stop(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """Stop the server's whole process group: vLLM's engine-core processes live there too."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace)
    with contextlib.suppress(ProcessLookupError):  # whatever outlived the leader (the pgid stays reserved)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_server(command: list[str], env: dict[str, str], url: str | None, timeout: float,
               ready: str = "vLLM extractor ready") -> int:
    """Run the server until it exits; return its exit status. The group never outlives this call.

    `url` None: a headless follower, which has no /health to wait for. `ready` starts the line said once it is up."""
    if url is not None:
        require_free(url)
    # Its own session: a terminal's Ctrl-C reaches only us, and we can kill the group as one.
    proc = subprocess.Popen(command, env={**os.environ, **env}, start_new_session=True)

    def forward(signum: int, _frame) -> None:  # `kill LAUNCHER` (or Ctrl-C) stops vLLM too
        # The server alone: it shuts its engine processes down in order (signalled together, the
        # engine dies first and the server logs EngineDeadError); `stop` below sweeps the group.
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        if url is None:  # a --headless follower serves no API, and runs until stopped (not with its head)
            print("vLLM headless follower started; it serves its head's requests", file=sys.stderr, flush=True)
        else:
            wait_healthy(url, proc, timeout)
            print(f"{ready} on {url}/v1", file=sys.stderr, flush=True)
        return exit_status(proc.wait())
    finally:
        stop(proc)
        for s, handler in previous.items():
            signal.signal(s, handler)


