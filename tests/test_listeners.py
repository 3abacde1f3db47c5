"""ringd/base/listeners.py: sockets bound by a launcher, handed down to a daemon by descriptor."""

from __future__ import annotations

import os
import socket

import pytest

from ringd.base.listeners import ListenerError, adopt, bind


def test_a_bound_listener_is_adopted_by_its_descriptor_and_accepts():
    sock = bind("127.0.0.1")
    port = sock.getsockname()[1]
    assert port > 0 and sock.get_inheritable()
    adopted = adopt(os.dup(sock.fileno()), "--ring-fd")
    sock.close()  # the launcher's copy goes; the adopted one listens on
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            adopted.setblocking(True)
            conn, _ = adopted.accept()
            conn.close()
    finally:
        adopted.close()


def test_a_port_in_use_is_an_os_error_naming_it():
    with bind("127.0.0.1") as taken, pytest.raises(OSError):
        bind("127.0.0.1", taken.getsockname()[1])


@pytest.mark.parametrize("what", ["file", "unlistened socket", "udp socket", "closed"])
def test_a_descriptor_that_is_no_listening_tcp_socket_is_refused_naming_the_flag(tmp_path, what):
    if what == "file":
        fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR)
    elif what == "unlistened socket":
        fd = socket.socket().detach()
    elif what == "udp socket":
        fd = socket.socket(type=socket.SOCK_DGRAM).detach()
    else:
        fd = os.open(tmp_path / "g", os.O_CREAT | os.O_RDWR)
        os.close(fd)
    try:
        with pytest.raises(ListenerError, match=rf"--http-fd {fd}: "):
            adopt(fd, "--http-fd")
    finally:
        if what != "closed":
            os.close(fd)
