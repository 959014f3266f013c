"""The other process of the cross-process UCX tests (run as `python -m tests.transfer.peer ...`).

    send ADDRESS ID:NBYTES:SEED ...   send each payload (`payload(nbytes, seed)`), print "sent ID" or
                                      "failed ID ERROR" each; exit 3 if any failed
    receive ID:NBYTES ...             listen, print "address ADDRESS", expect each id, print
                                      "received ID CRC32" as each lands; serve until killed
"""

from __future__ import annotations

import asyncio
import sys
import zlib

import numpy as np

from cluster.transfer.connector import KVHeader, TransferError
from cluster.transfer.ucx import UCXReceiver, UCXSender, reset_ucx


def payload(nbytes: int, seed: int) -> np.ndarray:
    """The bytes both processes agree on for (nbytes, seed)."""
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8)  # read-only, fast


def header(request_id: str, nbytes: int) -> KVHeader:
    return KVHeader(request_id=request_id, num_tokens=16, num_blocks=1, block_size=16, num_layers=1,
                    num_kv_heads=1, head_dim=64, dtype="uint8", first_token_id=nbytes % 1000, nbytes=nbytes)


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


async def receive(specs: list[str]) -> int:
    receiver = UCXReceiver(timeout_s=5.0)
    await receiver.start()
    print("address", receiver.address, flush=True)
    for spec in specs:
        request_id, nbytes = spec.split(":")
        buffer = np.zeros(int(nbytes), dtype=np.uint8)
        done = receiver.expect(request_id, memoryview(buffer))
        done.add_done_callback(lambda _, i=request_id, b=buffer: print("received", i, zlib.crc32(b), flush=True))
    await asyncio.Event().wait()  # until killed
    return 0


def main(argv: list[str]) -> int:
    command, *rest = argv
    if command == "send":
        code = asyncio.run(send(rest[0], rest[1:]))
        reset_ucx()
        return code
    return asyncio.run(receive(rest))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
