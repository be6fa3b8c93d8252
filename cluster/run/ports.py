"""Ports for the HTTP server: is one free, and a free one (plain sockets: checked before any
heavy import, so a port in use fails at once)."""
from __future__ import annotations

import contextlib
import errno
import socket


def check_port_free(host: str, port: int) -> None:
    """A ValueError naming the fix when the HTTP server could not bind host:port (uvicorn binds
    with SO_REUSEADDR too, so a port in TIME_WAIT counts as free)."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise ValueError(f"{host}:{port} {why}: choose another --port (or --host)") from None


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free ports: all bound at once, so the kernel never hands one out twice (free
    ports taken one after another may repeat, and two services then collide)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
