"""`python -m dspark.core.net wait`: the one readiness check of compose, Slurm and the tests' servers."""

import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dspark.core.net import free_port, wait


@pytest.fixture
def http_server():
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802  (http.server's name)
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *_):  # keep pytest's output clean
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def net(*args) -> subprocess.CompletedProcess:
    """`python -m dspark.core.net` in a child: the module is run as compose's and Slurm's scripts run it, and it
    imports nothing heavy (no torch), so a child costs a fraction of a second."""
    return subprocess.run([sys.executable, "-m", "dspark.core.net", *args], capture_output=True, text=True, timeout=60)


def test_ready_servers_pass_and_others_fail_with_one_line(http_server):
    with socket.create_server(("127.0.0.1", 0)) as listening:
        assert net("wait", f"tcp://127.0.0.1:{listening.getsockname()[1]}").returncode == 0
    assert net("wait", f"{http_server}/health").returncode == 0
    refused = net("wait", f"{http_server}/busy")  # answers, but not 2xx: not ready
    assert refused.returncode == 1 and refused.stderr == f"error: {http_server}/busy does not answer\n"
    closed = net("wait", f"tcp://127.0.0.1:{free_port('127.0.0.1')}", "--timeout", "1", "--name", "master")
    assert closed.returncode == 1 and "master (tcp://" in closed.stderr and "not ready after 1s" in closed.stderr


def test_waiting_stops_as_soon_as_the_starting_server_exits():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    why = wait(f"tcp://127.0.0.1:{free_port('127.0.0.1')}", timeout=60, pid=gone.pid, name="vLLM", every=0.1)
    assert why is not None and why.startswith("vLLM (tcp://") and why.endswith("exited before it was ready")


def test_waiting_ends_when_the_server_comes_up():
    port = free_port("127.0.0.1")
    late = threading.Timer(0.5, lambda: server.append(socket.create_server(("127.0.0.1", port))))
    server: list = []
    late.start()
    try:
        assert wait(f"tcp://127.0.0.1:{port}", timeout=30, every=0.1) is None
    finally:
        late.join()
        server[0].close()
