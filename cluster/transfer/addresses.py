"""Which address a KV listener advertises, so that a sender on another host can dial it.

The UCX listener binds every interface (ucxx takes no bind address); what matters is the address
written into the reservation the router hands to the prefill worker. By default that is the node's
own address as Ray knows it (`ray start --node-ip-address`); a pool can name a network interface
instead (an RDMA NIC, a dedicated KV network), resolved on each worker's own node. Never loopback
by assumption: on two hosts a sender dialling 127.0.0.1 reaches itself.
"""

from __future__ import annotations

import fcntl
import socket
import struct

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
LOOPBACK_PREFIX = "127."


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name` on this host (e.g. "ib0", "eth1")."""
    if not name or len(name) > 15 or "/" in name:
        raise ValueError(f"{name!r} is not a network interface name")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()))
        except OSError as error:
            raise ValueError(f"network interface {name!r} has no IPv4 address on this host "
                             f"({error.strerror}): set the pool's kv_interface to one that has") from None
    return socket.inet_ntoa(packed[20:24])


def is_loopback(host: str) -> bool:
    return host.startswith(LOOPBACK_PREFIX) or host in ("localhost", "::1")
