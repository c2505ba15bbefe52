"""`--host` sockets (server/listen.py): UNIX paths, a stale socket file, and a busy TCP port."""

from __future__ import annotations

import socket

import pytest

from hybridmoe.server.listen import describe_socket, listen_sockets


def test_unix_socket_replaces_a_stale_file_and_accepts(tmp_path):
    path = tmp_path / "hm.sock"
    path.write_text("stale")
    (sock,) = listen_sockets(str(path), 0)
    try:
        assert describe_socket(sock) == f"unix:{path}"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))
    finally:
        sock.close()


def test_busy_port_names_the_address_and_closes_the_others(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    path = tmp_path / "first.sock"
    try:
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            listen_sockets(f"{path},127.0.0.1", port)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:  # the first one was closed
            with pytest.raises(OSError):
                client.connect(str(path))
    finally:
        busy.close()
