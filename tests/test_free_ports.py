"""Ports the fixtures give services to listen on (infra.services.free_port): pure socket logic, no service."""

from __future__ import annotations

import socket

from diloco.infra import services


def test_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice():
    low = services._ephemeral_low()
    singles = [services.free_port() for _ in range(40)]
    base = services.free_port(count=3)
    taken = [*singles, base, base + 1, base + 2]
    assert len(set(taken)) == len(taken)       # distinct before any of them is bound
    assert all(1024 <= p < low for p in taken)  # no outgoing connection is given one of them
    for p in taken:                             # and each is free to listen on
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_something_listens_on_is_not_handed_out(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        free = services.free_port()
        services._handed_out.discard(free)  # as if never handed out: the draw below may return it
        draws = iter([port, port, free])  # the busy port comes up twice, then a free one
        monkeypatch.setattr(services.random, "randrange", lambda lo, hi: next(draws))
        assert services.free_port() == free
