"""The other process of the cross-process UCX tests (run as `python -m tests.transfer.peer ...`).

    send ADDRESS ID:NBYTES:SEED ...   send each payload (`payload(nbytes, seed)`), print "sent ID" or
                                      "failed ID ERROR" each; exit 3 if any failed
    receive ID:NBYTES ...             listen, print "address ADDRESS", expect each id, print
                                      "received ID CRC32" as each lands; serve until killed
    receive-shm DIR ID:NBYTES:TOKEN   the same, each landing in a shared-memory segment in DIR, whose
                                      name it prints first: "landing ID NAME"
    stall-shm DIR ADDRESS ID:NBYTES:TOKEN:SEED:LANDING
                                      send the first half-block frame of the payload in place, copy
                                      half of it, print "stalled" and hang there until killed
"""

from __future__ import annotations

import asyncio
import sys
import zlib
from dataclasses import replace

import numpy as np

from cluster.transfer import shm
from cluster.transfer.connector import KVHeader, TransferError
from cluster.transfer.ucx import UCXReceiver, UCXSender, reset_ucx


def payload(nbytes: int, seed: int) -> np.ndarray:
    """The bytes both processes agree on for (nbytes, seed)."""
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8)  # read-only, fast


def header(request_id: str, nbytes: int) -> KVHeader:
    return KVHeader(request_id=request_id, num_tokens=16, num_blocks=1, block_size=16, num_layers=1,
                    num_kv_heads=1, head_dim=64, dtype="uint8", first_token_id=nbytes % 1000, nbytes=nbytes)


def frames(request_id: str, nbytes: int, token: str, count: int = 2) -> list[KVHeader]:
    """`count` frames of one block each carrying `nbytes` in all (a multiple of `count`)."""
    return [KVHeader(request_id=request_id, num_tokens=16 * count, num_blocks=1, block_size=16, num_layers=1,
                     num_kv_heads=1, head_dim=64, dtype="uint8", first_token_id=7, nbytes=nbytes // count,
                     first_block=index, last=index == count - 1, token=token) for index in range(count)]


async def send(address: str, specs: list[str]) -> int:
    sender, code = UCXSender(timeout_s=5.0), 0
    payloads: dict[tuple[int, int], np.ndarray] = {}
    for spec in specs:
        request_id, nbytes, seed = spec.split(":")
        key = (int(nbytes), int(seed))
        data = payloads[key] = payloads[key] if key in payloads else payload(*key)
        try:
            await sender.send(address, header(request_id, int(nbytes)), memoryview(data))
            print("sent", request_id, flush=True)
        except TransferError as error:
            print("failed", request_id, repr(error), flush=True)
            code = 3
    await sender.close()
    return code


async def receive(specs: list[str], segment_dir: str = "") -> int:
    receiver = UCXReceiver(timeout_s=5.0, shared_memory=bool(segment_dir), segment_dir=segment_dir or shm.SHM_DIR)
    await receiver.start()
    for spec in specs:
        request_id, nbytes, *token = spec.split(":")
        landing = await receiver.landing_memory(token[0], int(nbytes)) if token else None
        buffer = np.frombuffer(landing, dtype=np.uint8) if landing else np.zeros(int(nbytes), dtype=np.uint8)
        done = receiver.expect(request_id, memoryview(buffer), *token)
        if token:
            print("landing", request_id, receiver.landing_name(token[0]), flush=True)
        done.add_done_callback(lambda _, i=request_id, b=buffer: print("received", i, zlib.crc32(b), flush=True))
    print("address", receiver.address, flush=True)  # once every transfer is expected
    await asyncio.Event().wait()  # until killed
    return 0


async def stall(segment_dir: str, address: str, spec: str) -> int:
    """Send a frame in place and hang halfway through its copy (a sender killed mid-copy)."""
    request_id, nbytes, token, seed, landing = spec.split(":")
    data, first = payload(int(nbytes), int(seed)), frames(request_id, int(nbytes), token)[0]
    same = shm.SameHost.of(address)
    assert same is not None, "the receiver offers no shared memory"

    async def write_half_and_hang() -> None:
        path = shm.segment_path(same.receiver_id, landing, segment_dir)
        async with shm.Mappings().window(path, 0, first.nbytes) as target:
            target[:first.nbytes // 2] = memoryview(data)[:first.nbytes // 2]
        print("stalled", flush=True)
        await asyncio.Event().wait()

    await UCXSender(timeout_s=5.0).send_raw(address, replace(first, in_place=True).to_bytes(),
                                             memoryview(data)[:first.nbytes], write=write_half_and_hang)
    return 0


def main(argv: list[str]) -> int:
    command, *rest = argv
    if command == "send":
        code = asyncio.run(send(rest[0], rest[1:]))
        reset_ucx()
        return code
    if command == "stall-shm":
        return asyncio.run(stall(*rest))
    if command == "receive-shm":
        return asyncio.run(receive(rest[1:], rest[0]))
    return asyncio.run(receive(rest))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
