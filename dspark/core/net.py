"""Ports for servers started on this host, and the one readiness check of every deployment.

    python -m dspark.core.net N                  N free ports (tests, benchmarks, the one-node Slurm check)
    python -m dspark.core.net wait URL [--timeout S] [--pid PID] [--name WHAT]
        exit 0 once URL answers: http(s)://... with a 2xx, tcp://HOST:PORT by accepting a connection;
        exit 1 with one line when S seconds pass (0: one probe, for container healthchecks) or the
        process PID, the server starting, exits first.
"""

import os
import random
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from dspark.core.errors import InputError
from dspark.core.settings import add_arguments, parsed_config, setting

# Kernel-chosen ports (connect()'s source ports, bind to port 0) come from this range on Linux.
_EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"
_given: set[int] = set()  # never hand out a port twice in one process: its server may not be up yet


def free_port(host: str) -> int:
    """A port free now on `host` (where its server will listen: "127.0.0.1", or "" for every interface),
    outside the kernel's ephemeral range, and not given out before.

    A port the kernel handed out (bind to port 0) is in that range, so until its
    server binds it, any outgoing connection or bind to port 0 on the host may take
    it (a client retrying connect() to it on loopback can even connect to itself).
    The one-node Slurm check lost the vLLM pair's rendezvous port that way: EADDRINUSE
    at the head's bind, while the headless rank kept connecting to it. The kernel
    never hands out ports below the range.
    """
    try:
        with open(_EPHEMERAL) as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    candidates = [p for p in range(20000, max(20001, low)) if p not in _given]
    for port in random.sample(candidates, min(200, len(candidates))):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise OSError(f"no free port between 20000 and {low} on {host}")


def ready(url: str, timeout: float = 5.0) -> bool:
    """Whether `url` answers now: an HTTP 2xx (no proxy: these servers are on the job's own network), or a
    TCP connection accepted (tcp://HOST:PORT)."""
    parts = urllib.parse.urlsplit(url)
    try:
        if parts.scheme == "tcp":
            socket.create_connection((parts.hostname, parts.port), timeout=timeout).close()
            return True
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url, timeout=timeout) as reply:
            return 200 <= reply.status < 300
    except (OSError, ValueError, urllib.error.URLError):
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        pass
    return True


def wait(url: str, timeout: float, pid: int | None = None, name: str | None = None, every: float = 1.0) -> str | None:
    """None once `url` is ready; else why not (timed out, or process `pid` exited first)."""
    what = f"{name} ({url})" if name else url
    deadline = time.monotonic() + timeout
    while not ready(url):
        if pid is not None and not _alive(pid):
            return f"{what} exited before it was ready"
        if time.monotonic() >= deadline:
            return f"{what} not ready after {timeout:g}s" if timeout else f"{what} does not answer"
        time.sleep(every)
    return None


@dataclass
class WaitConfig:
    """`python -m dspark.core.net wait`: exit 0 once a server answers."""

    url: str = setting(help="http(s)://HOST:PORT/PATH (a 2xx) or tcp://HOST:PORT (a connection).", positional=True)
    timeout: float = setting(0.0, "Seconds to keep trying (0: one probe).", ge=0)
    pid: int | None = setting(None, "Fail as soon as this process (the server starting) exits.", ge=1)
    name: str | None = setting(None, "What the error line calls the server.")


def _main(argv: list[str]) -> int:
    if argv[:1] != ["wait"]:
        print(*(free_port("") for _ in range(int(argv[0]) if argv else 1)))
        return 0
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dspark.core.net wait", description=WaitConfig.__doc__)
    add_arguments(parser, WaitConfig, config_file=False)
    try:
        cfg = parsed_config(WaitConfig, parser.parse_args(argv[1:]))
        why = wait(cfg.url, cfg.timeout, cfg.pid, cfg.name)
    except InputError as e:
        why = str(e)
    if why:
        print(f"error: {why}", file=sys.stderr)
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
