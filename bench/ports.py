"""Loopback port ranges for engines that tests and benchmarks start, safe when several run at once.

A port taken from the kernel (``bind(0)``) comes from the ephemeral range, which every outgoing
TCP connection also draws its local port from: between the probe and the engine binding it,
any client (deo's, the test's, another suite's) may take it. So ranges are taken *below* the
ephemeral range, in fixed blocks of :data:`BLOCK_PORTS`, and each block is claimed with an
``fcntl`` lock on a file under the temporary directory, held until the process exits (or
:meth:`PortRange.release`), so that a concurrent suite on the same machine skips it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path
from typing import IO

__all__ = ["BLOCK_PORTS", "PortRange", "reserve_port", "reserve_port_range"]

#: Ports per claimed block: the most one range may hold.
BLOCK_PORTS = 16
#: Blocks are taken from here up to the start of the ephemeral range.
LOWEST_PORT = 20000
_LOCK_DIR = Path(tempfile.gettempdir()) / "deo-test-ports"
#: Blocks this process holds (their locks last as long as the process, unless released).
_held: list[PortRange] = []


def _ephemeral_low() -> int:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class PortRange:
    """``count`` consecutive loopback ports from ``first``, claimed by a lock file."""

    def __init__(self, first: int, count: int, lock: IO[bytes]) -> None:
        self.first = first
        self.count = count
        self._lock: IO[bytes] | None = lock

    @property
    def ports(self) -> range:
        return range(self.first, self.first + self.count)

    def release(self) -> None:
        """Give the block back (closing the file drops its lock)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None
            with contextlib.suppress(ValueError):
                _held.remove(self)


def _all_bindable(first: int, count: int) -> bool:
    for port in range(first, first + count):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def reserve_port_range(count: int) -> PortRange:
    """A claimed block's first ``count`` ports, all free now; RuntimeError if none is left."""
    if not 1 <= count <= BLOCK_PORTS:
        raise ValueError(f"count must be 1..{BLOCK_PORTS}, got {count}")
    blocks = list(range(LOWEST_PORT, _ephemeral_low() - BLOCK_PORTS + 1, BLOCK_PORTS))
    random.shuffle(blocks)
    _LOCK_DIR.mkdir(parents=True, exist_ok=True)
    for first in blocks:
        lock = (_LOCK_DIR / f"{first}.lock").open("ab")
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue  # another process holds it
        if not _all_bindable(first, count):
            lock.close()
            continue
        os.set_inheritable(lock.fileno(), False)
        claimed = PortRange(first, count, lock)
        _held.append(claimed)
        return claimed
    raise RuntimeError(f"no free block of {count} loopback ports below the ephemeral range")


def reserve_port() -> int:
    """One claimed loopback port below the ephemeral range (held until the process exits)."""
    return reserve_port_range(1).first
