"""The KV connector interface: how a prefill worker's KV blocks reach a decode worker.

Who calls what, and who frees which blocks:

    decode worker                                   prefill worker
    -------------                                   --------------
    engine.reserve_remote(...) -> block ids
    buffer = staging buffer for those blocks
    done = receiver.expect(request_id, buffer)
    (tells the router receiver.address)  ──────>    engine runs the prompt chunk by chunk; after
                                                    each step, the blocks that became final:
                                                    await sender.send(address, header, run)
                                                    ... the prompt finishes, token 1 is sampled:
                                                    the last run, with token 1 (`last=True`);
                                                    engine.release_held(request_id)  # its blocks
    header = await done       (all runs landed in order, each at its offset in `buffer`)
    write buffer into the reserved blocks
    engine.admit_remote(request_id, header.first_token_id)

A receive that fails, is cancelled or times out leaves the decode worker's reserved blocks to the
decode worker (`engine.fail_remote` recomputes the prompt locally; an abort frees them). A send that
fails leaves the prefill worker's held blocks to the prefill worker (`release_held`). Nothing from
the network is unpickled: the header is msgpack of plain fields, the payload raw bytes.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import msgpack

MAX_HEADER_BYTES = 4096
HEADER_VERSION = 5
MAX_TOKEN_CHARS = 64  # a transfer's token (`KVTicket.token`): 32 hex digits
MAX_TRACEPARENT_CHARS = 128  # a W3C traceparent has 55; its content is parsed (or ignored) by the tracer


class DeviceBytes(Protocol):
    """Flat bytes in GPU memory (a 1-D uint8 CUDA tensor): what a connector whose
    `carries_device_memory` is true sends from and receives into with no host copy."""

    @property
    def nbytes(self) -> int: ...

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...

    def __getitem__(self, index: slice) -> Any: ...


# What connectors carry: host bytes, or device bytes where the connector says it can.
KVBytes = memoryview | DeviceBytes


class TransferError(RuntimeError):
    """A transfer failed: the peer is gone, refused it, or sent something malformed."""


class TransferState(enum.IntEnum):
    PENDING = 0  # expected, nothing arrived yet
    RECEIVING = 1  # a frame's payload is landing
    DONE = 2
    FAILED = 3
    CANCELLED = 4
    PARTIAL = 5  # some frames landed, more to come


@dataclass(frozen=True, slots=True)
class KVHeader:
    """Describes one frame of a request's KV: a run of `num_blocks` blocks starting at `first_block`,
    laid out blocks x layers x (key, value) x block_size x heads x dim. A request's frames arrive in
    order; the `last` one completes it and carries the first token (`first_token_id`)."""

    request_id: str
    num_tokens: int  # prompt tokens whose keys and values the whole transfer holds
    num_blocks: int  # in this frame
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    first_token_id: int  # meaningful on the last frame
    nbytes: int  # of this frame's payload
    first_block: int = 0
    last: bool = True
    token: str = ""  # the transfer's one-time token, from the decode worker's `KVTicket`
    # The sender's span (W3C traceparent), so the receiver's span joins the request's trace; "" untraced.
    traceparent: str = ""
    # The payload is not on the wire: the sender wrote it into the receiver's shared-memory segment
    # (same host, `shm.py`) and sends a 1-byte "written" marker in its place.
    in_place: bool = False

    @property
    def block_nbytes(self) -> int:
        return self.nbytes // self.num_blocks

    def to_bytes(self) -> bytes:
        data: bytes = msgpack.packb({"version": HEADER_VERSION, **asdict(self)})
        if len(data) > MAX_HEADER_BYTES:
            raise TransferError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
        return data

    @classmethod
    def from_bytes(cls, data: bytes) -> KVHeader:
        """Parse and validate a header from the network; raises TransferError on anything odd."""
        if len(data) > MAX_HEADER_BYTES:
            raise TransferError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
        try:
            fields: Any = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as error:  # msgpack raises several types for malformed input
            raise TransferError(f"malformed header: {error}") from error
        if not isinstance(fields, dict) or fields.pop("version", None) != HEADER_VERSION:
            raise TransferError(f"malformed header: not a version-{HEADER_VERSION} KV header")
        try:
            header = cls(**fields)
        except TypeError as error:
            raise TransferError(f"malformed header: {error}") from error
        header.validate()
        return header

    def validate(self) -> None:
        ints = (self.num_tokens, self.num_blocks, self.block_size, self.num_layers, self.num_kv_heads,
                self.head_dim, self.first_token_id, self.nbytes, self.first_block)
        if not isinstance(self.request_id, str) or not isinstance(self.dtype, str) or \
                not isinstance(self.last, bool) or not isinstance(self.in_place, bool) or \
                not isinstance(self.token, str) or \
                len(self.token) > MAX_TOKEN_CHARS or not isinstance(self.traceparent, str) or \
                len(self.traceparent) > MAX_TRACEPARENT_CHARS or \
                not all(isinstance(value, int) and not isinstance(value, bool) and value >= 0 for value in ints):
            raise TransferError("malformed header: wrong field types")
        if self.num_blocks == 0 or self.nbytes % self.num_blocks:
            raise TransferError("malformed header: a frame holds a whole number of blocks, at least one")
        if self.num_tokens == 0 or self.block_size == 0:
            raise TransferError("malformed header: no tokens")
        # The last frame ends with the prompt's last block; the others stop before it.
        last_block = (self.num_tokens - 1) // self.block_size
        stop = self.first_block + self.num_blocks
        if stop != last_block + 1 if self.last else stop > last_block:
            raise TransferError("malformed header: the blocks do not match the tokens")


class KVSender(Protocol):
    """Prefill side."""

    @property
    def carries_device_memory(self) -> bool:
        """Whether `send` takes a payload in GPU memory (`DeviceBytes`)."""
        ...

    async def send(self, address: str, header: KVHeader, payload: KVBytes, landing: str = "") -> str | None:
        """Deliver header and payload to the receiver at `address`; raises TransferError. `landing`:
        the ticket's name of the receiver's shared-memory segment for the transfer, if it gave one.
        Returns the transport the payload took ("shm", "ucx"), or None where the connector has only one."""
        ...

    def transport_to(self, address: str, landing: str = "") -> str:
        """The transport a send to `address` (for the transfer whose ticket names `landing`) takes
        (traces, stats): "shm" for a receiver on this host that gave the transfer a shared-memory segment."""
        ...

    async def start(self) -> None:
        """Get ready to send (the worker calls it as it starts), so that the first send does not pay
        for what every send needs once (UCX: its import and initialisation)."""
        ...

    async def close(self) -> None: ...


class KVReceiver(Protocol):
    """Decode side: payloads land in buffers registered in advance, never anywhere else."""

    address: str

    @property
    def carries_device_memory(self) -> bool:
        """Whether `expect` takes a buffer in GPU memory (`DeviceBytes`)."""
        ...

    async def start(self) -> None: ...

    async def landing_memory(self, token: str, nbytes: int) -> memoryview | None:
        """Host memory of `nbytes` to pass to `expect` for the transfer with `token`, which a sender on
        this host can write straight into (shared memory), or None: use ordinary memory. Awaited:
        new shared memory is faulted in off the event loop."""
        ...

    def landing_name(self, token: str) -> str:
        """The name of the shared memory `landing_memory` gave the transfer with `token` ("" if none),
        for its ticket: a sender on this host opens it by that name. Random: it tells nothing of the
        token (anyone on the host can list the names)."""
        ...

    async def prefault_landing_up_to(self, largest: int) -> int:
        """Make the shared memory that `landing_memory` hands out for transfers of up to `largest`
        bytes now (off the event loop), so that the first transfers do not wait for it; how many
        segments were made (0: none needed, or no shared memory)."""
        ...

    def expect(self, request_id: str, buffer: KVBytes, token: str = "") -> asyncio.Future[KVHeader]:
        """Accept one payload for `request_id`, of exactly `buffer.nbytes`, written into `buffer`, in
        frames whose header carries `token` (others are refused UNAUTHENTICATED, harmlessly).

        The future resolves to the header once the payload is in place, or fails with TransferError
        (wrong size, peer lost) or CancelledError (`cancel`). Frames for ids not expected are refused.
        """
        ...

    def state(self, request_id: str) -> TransferState | None: ...

    def cancel(self, request_id: str) -> None: ...

    async def close(self) -> None: ...
