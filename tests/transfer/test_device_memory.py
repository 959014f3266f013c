"""KV in GPU memory through the connectors: which ones take it, what a device buffer must look like,
and (under the `gpu` marker) UCX moving bytes from and into device memory bit for bit."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
import torch

from cluster.transfer.loopback import (
    LoopbackHub,
    LoopbackReceiver,
    LoopbackSender,
    ReceiveTable,
    readable_bytes,
    writable_bytes,
)
from tests.transfer.conftest import HAS_UCXX, Pair
from tests.transfer.test_connectors import header_for, random_payload


class FakeDeviceBytes:
    """Looks like flat device bytes to the connectors' checks; its pointer is host memory, so it must
    never reach UCX (these tests only check validation and slicing)."""

    def __init__(self, nbytes: int, offset: int = 0, *, typestr: str = "|u1", shape: tuple[int, ...] | None = None,
                 strides: tuple[int, ...] | None = None, readonly: bool = False) -> None:
        self.nbytes, self.offset = nbytes, offset
        self.__cuda_array_interface__: dict[str, Any] = {
            "typestr": typestr, "shape": shape or (nbytes,), "strides": strides, "data": (4096 + offset, readonly),
            "version": 3}

    def __getitem__(self, index: slice) -> FakeDeviceBytes:
        start, stop, _ = index.indices(self.nbytes)
        return FakeDeviceBytes(stop - start, self.offset + start)


@pytest.mark.parametrize("check", [readable_bytes, writable_bytes])
def test_flat_device_bytes_pass_as_they_are(check: Any) -> None:
    buffer = FakeDeviceBytes(64)
    assert check(buffer) is buffer


@pytest.mark.parametrize("fields", [{"typestr": "<f4"}, {"shape": (8, 8)}, {"strides": (2,)}],
                         ids=["not-bytes", "two-dims", "strided"])
@pytest.mark.parametrize("check", [readable_bytes, writable_bytes])
def test_device_buffers_that_are_not_flat_bytes_are_refused(check: Any, fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="flat bytes"):
        check(FakeDeviceBytes(64, **fields))


def test_a_read_only_device_buffer_can_be_sent_but_not_received_into() -> None:
    buffer = FakeDeviceBytes(64, readonly=True)
    assert readable_bytes(buffer) is buffer
    with pytest.raises(ValueError, match="read-only"):
        writable_bytes(buffer)


def test_a_frame_of_a_device_buffer_is_its_slice_at_the_frame_offset() -> None:
    # Two frames of two 1,024-byte blocks each into a 4-block buffer: the second lands at byte 2,048.
    first = dataclasses.replace(header_for("r1", 2048), num_tokens=64, last=False)
    second = dataclasses.replace(first, first_block=2, last=True)

    async def body() -> None:
        table = ReceiveTable()
        done = table.expect("r1", FakeDeviceBytes(4096))
        frame = table.admit(first)
        assert (frame.offset, frame.nbytes) == (0, 2048)
        table.complete(first)
        frame = table.admit(second)
        assert (frame.offset, frame.nbytes) == (2048, 2048)
        table.complete(second)
        assert (await done) == second

    asyncio.run(body())


def test_the_loopback_connector_refuses_device_memory_plainly() -> None:
    async def body() -> None:
        hub = LoopbackHub()
        receiver, sender = LoopbackReceiver(hub, "decode-0"), LoopbackSender(hub)
        await receiver.start()
        assert not receiver.carries_device_memory and not sender.carries_device_memory
        with pytest.raises(ValueError, match="host memory only"):
            receiver.expect("r1", FakeDeviceBytes(1024))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="host memory only"):
            await sender.send(receiver.address, header_for("r1", 1024), FakeDeviceBytes(1024))  # type: ignore[arg-type]

    asyncio.run(body())


@pytest.mark.parametrize("transports, expected", [
    ("", True), ("all", True), ("cuda", True), ("tcp,cuda_copy", True), ("rc, cuda_copy, gdr_copy", True),
    ("tcp", False), ("sm,self", False), ("rc,tcp", False), ("^cuda_copy", False), ("^tcp,cuda", False),
    ("^tcp", True), ("^rc,sm", True),
])
def test_ucx_carries_device_memory_where_its_cuda_copy_transport_is_allowed(transports: str, expected: bool) -> None:
    from cluster.transfer.ucx import ucx_carries_device_memory

    assert ucx_carries_device_memory(transports) is expected


def test_ucx_connectors_follow_the_environment_when_given_no_transports(monkeypatch: pytest.MonkeyPatch) -> None:
    if not HAS_UCXX:
        pytest.skip("ucxx is not installed")
    from cluster.transfer.ucx import UCXReceiver, UCXSender

    monkeypatch.setenv("UCX_TLS", "tcp")
    assert not UCXSender().carries_device_memory and not UCXReceiver().carries_device_memory
    assert UCXSender(transports="tcp,cuda_copy").carries_device_memory
    monkeypatch.delenv("UCX_TLS")
    assert UCXReceiver().carries_device_memory


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("source, target", [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")])
def test_ucx_moves_kv_from_and_into_device_memory_bit_for_bit(ucx_pair: Pair, source: str, target: str) -> None:
    nbytes = 8 << 20
    payload = torch.from_numpy(random_payload(nbytes).reshape(-1).copy()).to(source)
    buffer = torch.full((nbytes,), 0xAB, dtype=torch.uint8, device=target)
    torch.cuda.set_device(0)

    def wire(tensor: torch.Tensor) -> Any:
        return tensor if tensor.is_cuda else memoryview(tensor.numpy())

    async def body() -> None:
        done = ucx_pair.receiver.expect("d1", wire(buffer))
        await ucx_pair.sender.send(ucx_pair.receiver.address, header_for("d1", nbytes), wire(payload))
        await asyncio.wait_for(done, 10)

    ucx_pair.run(body())
    assert torch.equal(buffer.cpu(), payload.cpu())
