"""A free loopback port for a process that must be told its port before it starts.

Port 0 (the OS picks, the server reports) is always the first choice. Where a port must be
written down in advance (a Ray head's, or a server in another process), a port from the kernel's
ephemeral range is a poor pick: every outgoing connection made meanwhile (Ray opens hundreds)
takes its local port from that range, and one of them can hold the port by the time the server
binds it ("address already in use"). So this picks below that range, where no connection is
given a port unasked.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Ray's default worker ports are 10002-19999; above them and below the ephemeral range is free.
_LOW = 20000


def _ephemeral_low() -> int:
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_fixed_port(attempts: int = 200) -> int:
    """A 127.0.0.1 TCP port nothing is bound to, outside the ephemeral range."""
    high = _ephemeral_low()
    if high - _LOW < 100:  # an unusual ephemeral range: fall back to the OS's pick
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])
    rng = random.Random()
    for _ in range(attempts):
        port = rng.randrange(_LOW, high)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_LOW}-{high - 1} after {attempts} tries")
