"""Ports for servers started on this host (tests, benchmarks, the one-node Slurm check)."""

import random
import socket

# Kernel-chosen ports (connect()'s source ports, bind to port 0) come from this range on Linux.
_EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"
_given: set[int] = set()  # never hand out a port twice in one process: its server may not be up yet


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, outside the kernel's ephemeral range, and not given out before.

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


if __name__ == "__main__":  # python -m dspark.net N: N distinct ports for a shell script
    import sys

    print(*(free_port("") for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 1)))
