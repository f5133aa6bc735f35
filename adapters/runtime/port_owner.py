"""Whose is a listening TCP port: so that deo never takes another program's server for an engine.

An engine's port may already be held by something else (another program, a leftover of an
earlier run): the engine then fails to bind, while the server that holds the port answers deo's
``/health``. :func:`port_held_by` says whether the socket listening on a loopback port belongs
to a process of the engine's session (the engine runs in a session of its own, so its workers
and wrappers are counted with it), from ``/proc/net/tcp{,6}`` (the socket's inode) and
``/proc/PID/fd`` (which processes hold that inode).

Where ``/proc`` cannot say (not Linux, a listener not found, another user's files), the answer
is None: unknown, which deo takes as the engine's (it did before this check existed).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["listening_inodes", "port_held_by", "session_pids"]

_PROC = Path("/proc")
_LISTEN = "0A"


def listening_inodes(port: int, proc: Path = _PROC) -> set[int]:
    """The inodes of the TCP sockets listening on ``port`` (any address, IPv4 or IPv6)."""
    found: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[9].isdigit():
                found.add(int(fields[9]))
    return found


def session_pids(pid: int, proc: Path = _PROC) -> set[int]:
    """``pid`` and every process of the session it leads (its children, unless they left)."""
    pids = {pid}
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # After the command name (which may hold spaces): state ppid pgrp session ...
        fields = stat.rsplit(")", 1)[1].split()
        if len(fields) > 3 and int(fields[3]) == pid:
            pids.add(int(entry.name))
    return pids


def port_held_by(port: int, pid: int, proc: Path = _PROC) -> bool | None:
    """Whether the socket listening on ``port`` is held by ``pid``'s session: True, False (held
    by another process), or None (``/proc`` cannot say)."""
    inodes = listening_inodes(port, proc)
    if not inodes:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    # The engine itself first (the usual holder); its session only if it is not.
    held = _holds(pid, wanted, proc)
    if held:
        return True
    readable = held is not None
    for owner in session_pids(pid, proc) - {pid}:
        held = _holds(owner, wanted, proc)
        if held:
            return True
        readable = readable or held is not None
    return False if readable else None


def _holds(pid: int, sockets: set[str], proc: Path) -> bool | None:
    """Whether ``pid`` has one of ``sockets`` open (None: its descriptors cannot be read)."""
    try:
        fds = list(os.scandir(proc / str(pid) / "fd"))
    except OSError:
        return None
    for fd in fds:
        try:
            if os.readlink(fd.path) in sockets:
                return True
        except OSError:
            continue
    return False
