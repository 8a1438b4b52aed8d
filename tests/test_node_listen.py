"""Where a node listens: control on a port and the ring on the next one up, so that a node restarted on its control
address (`--listen HOST:PORT`, as after a crash) binds the very ports it had."""

from __future__ import annotations

import pytest

from primaplug.core.errors import ConfigError
from primaplug.node.daemon import _listen
from primaplug.transport import InprocNetwork, InprocTransport
from primaplug.transport.addresses import parse_endpoint

HOST = "127.0.0.1"


def _port(address: str) -> int:
    return parse_endpoint(address)[1]


def test_port_0_picks_a_free_pair_past_a_taken_neighbour() -> None:
    t = InprocTransport(InprocNetwork())
    taken = t.ring_in(HOST, 49153)  # the neighbour of the first port that port 0 would give
    control, ring = _listen(t, HOST, 0)
    assert _port(ring.address) == _port(control.address) + 1
    assert _port(control.address) not in (49152, 49153) and _port(ring.address) != _port(taken.address)
    t.close()


def test_a_fixed_port_whose_neighbour_is_taken_is_refused_and_frees_what_it_bound() -> None:
    t = InprocTransport(InprocNetwork())
    t.ring_in(HOST, 50001)
    with pytest.raises(ConfigError, match="50001"):
        _listen(t, HOST, 50000)
    control = t.control_server(HOST, 50000)  # the control port was let go again
    assert _port(control.address) == 50000
    t.close()


def test_a_restart_on_the_control_port_gets_the_same_pair_over_zeromq() -> None:
    from primaplug.transport.sockets import ZmqTransport

    first = ZmqTransport()
    control, ring = _listen(first, HOST, 0)
    pair = (_port(control.address), _port(ring.address))
    first.close()
    again = ZmqTransport()
    control, ring = _listen(again, HOST, pair[0])
    assert (_port(control.address), _port(ring.address)) == pair
    again.close()


def test_port_0_with_no_free_pair_says_so_and_binds_nothing() -> None:
    from primaplug.node.daemon import PAIR_TRIES

    network = InprocNetwork()
    t = InprocTransport(network)
    for k in range(2 * PAIR_TRIES):  # every port that port 0 would give next has its neighbour taken
        t.ring_in(HOST, 49153 + 2 * k)
    held = set(network.bound)
    with pytest.raises(ConfigError, match=f"no two free consecutive ports on {HOST} in {PAIR_TRIES} tries"):
        _listen(t, HOST, 0)
    assert set(network.bound) == held  # every control port it tried was let go
    t.close()
