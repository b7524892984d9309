"""Loopback ports a test holds itself, instead of assuming that nothing listens on one.

`refused_port()` binds a TCP socket on 127.0.0.1 and keeps it bound but not listening while
the block runs: no other process can bind the port meanwhile, and the kernel answers every
connect() with a reset, so a client gets ECONNREFUSED every time, not by luck.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Iterator


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A port on 127.0.0.1 that refuses connections until the block ends."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))  # no listen(): bound, so reserved, and refusing
        port = held.getsockname()[1]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            result = probe.connect_ex(("127.0.0.1", port))
        assert result == errno.ECONNREFUSED, f"127.0.0.1:{port}: connect gave {result}"
        yield port
