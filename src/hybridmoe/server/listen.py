"""Listening sockets for `--host`, which takes llama-server's comma-separated list of addresses
(IPv4, IPv6, host names) or UNIX socket paths ending in `.sock`. With several TCP addresses, `::`
binds IPv6 only (llama-server's rule), so `0.0.0.0,::` does not collide."""

from __future__ import annotations

import os
import socket

BACKLOG = 2048


def listen_sockets(hosts: str, port: int) -> list[socket.socket]:
    """Bound, listening sockets for every address in `hosts`, or ValueError saying which one failed
    and why (port in use, an address this machine does not have, a name that does not resolve)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port} is not a TCP port (0-65535)")
    names = [h.strip() for h in hosts.split(",") if h.strip()] or ["127.0.0.1"]
    tcp = [h for h in names if not h.endswith(".sock")]
    out: list[socket.socket] = []
    for name in names:
        try:
            out.append(_unix(name) if name.endswith(".sock") else _tcp(name.strip("[]"), port, v6only=len(tcp) > 1))
        except OSError as e:
            for s in out:
                s.close()
            where = name if name.endswith(".sock") else f"{name}:{port}"
            raise ValueError(f"cannot listen on {where}: {e.strerror or e}") from None
    return out


def _tcp(host: str, port: int, v6only: bool) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    options = [(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)]
    if family == socket.AF_INET6:
        options.append((socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1 if v6only else 0))
    return _bind(sock, addr, options)


def _unix(path: str) -> socket.socket:
    if os.path.exists(path):
        os.unlink(path)  # a stale socket file from an earlier run
    return _bind(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), path, [])


def _bind(sock: socket.socket, addr: object, options: list[tuple[int, int, int]]) -> socket.socket:
    """Set `options`, bind and listen; a failure closes the socket so no descriptor leaks."""
    try:
        for level, name, value in options:
            sock.setsockopt(level, name, value)
        sock.bind(addr)
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def describe_socket(sock: socket.socket, scheme: str = "http") -> str:
    if sock.family == socket.AF_UNIX:
        return f"unix:{sock.getsockname()}"
    host, port = sock.getsockname()[:2]
    return f"{scheme}://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"{scheme}://{host}:{port}"
