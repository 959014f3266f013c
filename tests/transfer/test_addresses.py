"""The address a KV listener advertises when a pool names a network interface."""

from __future__ import annotations

import pytest

from cluster.transfer.addresses import interface_address, is_loopback


def test_an_interface_resolves_to_its_ipv4_address() -> None:
    assert interface_address("lo") == "127.0.0.1"


@pytest.mark.parametrize("name", ["no-such-nic0", "", "x" * 16, "a/b"])
def test_an_unknown_interface_is_refused_with_its_name(name: str) -> None:
    with pytest.raises(ValueError, match="interface"):
        interface_address(name)


def test_loopback_is_recognised() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("127.8.0.1") and is_loopback("::1")
    assert not is_loopback("10.213.7.2")
