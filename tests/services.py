"""Session-scoped services many tests only read: the Mooncake master and `dspark serve` (a pytest plugin).

The helpers start a service of a test's own (for a test that kills it, or needs a master no one else mounts
memory on); the fixtures share one per session among the tests that only read and write keys of their own
through it. Mooncake keys are scoped by the store identity (verifier, layers, prepared fingerprint): tests
that share a master either use an identity of their own, or a live source whose cache is their own, which
requests every sample it misses (the server replaces the object), so no test reads another's objects.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from conftest import LAYERS, wait_for
from dspark.core.net import free_port

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_master(tmp_path, port=None):
    port = port or free_port("127.0.0.1")
    log = open(tmp_path / f"master-{port}.log", "w")
    # `dspark mooncake-master` becomes the master (exec): the pid is the server's, as in compose and Slurm.
    proc = subprocess.Popen([str(Path(sys.executable).parent / "dspark"), "mooncake-master", "--port", str(port),
                             "--metrics-port", str(free_port("127.0.0.1")), "--rpc-threads", "4"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_for(lambda: _port_open(port), 20, "mooncake_master")
    return proc, f"127.0.0.1:{port}"


def stop(proc, sig=signal.SIGKILL):
    """Kill the process group; SIGTERM lets the vLLM launcher take its server (own group) down with it."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start_extractor(tmp_path, verifier, prepared, master_addr, engine="serve", serve_segment_gib=0.25, port=None):
    """`dspark serve`, or real vLLM with our KV connector through the seed's launcher: same flags, same replies."""
    port = port or free_port("127.0.0.1")
    common = ["--hidden-states-backend", "mooncake", "--mooncake-master", master_addr,
              "--target-layer-ids", *map(str, LAYERS)]
    if engine == "serve":
        argv = [sys.executable, "-m", "dspark.cli", "serve", "--model", verifier, "--port", str(port), *common,
                "--mooncake-global-segment-gib", str(serve_segment_gib), "--data", prepared]
    else:  # the producer mounts no memory (the trainer does), so stopping it loses nothing
        assert VLLM_PY.exists(), "run `bash scripts/setup.sh --vllm`: the vLLM tests run in CI"
        argv = [str(VLLM_PY), "scripts/launch_vllm.py", str(verifier), *common, "--mooncake-global-segment-gib", "0",
                "--", "--port", str(port), "--enforce-eager", "--max-model-len", "1024"]
    log = open(tmp_path / f"{engine}-{port}.log", "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)

    def healthy():
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200
        except OSError:
            assert proc.poll() is None, (tmp_path / f"{engine}-{port}.log").read_text()[-3000:]
            return False

    wait_for(healthy, 300, engine)
    return proc, f"http://127.0.0.1:{port}/v1"


def small_cfg(mb: float = 256):
    from dspark.connector.config import MooncakeConfig

    return MooncakeConfig(global_segment_gib=mb / 1024, local_buffer_gib=mb / 1024)


@dataclass
class Service:
    """A shared server: its process, its address (a master's host:port, an extractor's /v1 URL), its logs'
    folder, and for an extractor how to start it again (a test that kills it leaves the next a fresh one)."""

    proc: subprocess.Popen
    address: str
    logs: Path
    restart: Callable[[], tuple[subprocess.Popen, str]] | None = None

    def up(self) -> str:
        """Its address, once it is known to be running: started again if a test killed it (a master is never:
        the tests that kill one start their own), resumed if one left it stopped.

        Collects garbage first: a client an earlier test left in a reference cycle would otherwise unmount
        its segment (and the objects a producer that mounts none placed there) at some moment in a later test.
        """
        gc.collect()
        if self.proc.poll() is not None and self.restart is not None:
            self.proc, self.address = self.restart()
        assert self.proc.poll() is None, f"a shared service died (exit {self.proc.returncode}); see {self.logs}"
        os.killpg(self.proc.pid, signal.SIGCONT)
        return self.address


@pytest.fixture(scope="session")
def live_master(tmp_path_factory):
    """One Mooncake master for every test that only reads and writes keys of its own through it."""
    pytest.importorskip("mooncake.store", reason="install the mooncake extra: pip install -e '.[mooncake]'")
    logs = tmp_path_factory.mktemp("live-master")
    proc, address = start_master(logs)
    yield Service(proc, address, logs)
    stop(proc)


def _extractor(tmp_path_factory, verifier, prepared, live_master, engine):
    logs = tmp_path_factory.mktemp(f"live-{engine}")

    def start():
        return start_extractor(logs, verifier, prepared, live_master.up(), engine)

    return Service(*start(), logs, start)


@pytest.fixture(scope="session")
def live_serve(tmp_path_factory, verifier, prepared, live_master):
    """`dspark serve` on the session master, mounting 0.25 GiB (its puts stay in its own segment); a test
    that kills it (the serve victim of test_live's lost-service test) leaves the next one asking a fresh one."""
    service = _extractor(tmp_path_factory, verifier, prepared, live_master, "serve")
    yield service
    stop(service.proc, signal.SIGTERM)


@pytest.fixture(scope="session")
def live_vllm(tmp_path_factory, verifier, prepared, live_master):
    """vLLM with our KV connector on the session master, mounting no memory: one engine start per session
    (two in one that runs test_live's vllm lost-service test, which kills it, before another reader)."""
    service = _extractor(tmp_path_factory, verifier, prepared, live_master, "vllm")
    yield service
    stop(service.proc, signal.SIGTERM)
