"""What a worker reports about itself: its load (what routers rank workers by, and /metrics and
`pdserve status` show), the stats of each KV transfer it sent, and the ticket a decode worker gives
out for a transfer it expects."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class KVTicket:
    """Where a prefill worker sends one request's KV, and the one-time token the decode worker accepts
    its frames with: a peer that can reach the receiver's port but was not given the ticket (it
    travels in Ray calls only) cannot land bytes in a reserved buffer. Printed, it is its address."""

    address: str
    token: str = field(repr=False)

    def __str__(self) -> str:
        return self.address


@dataclass(slots=True)
class TransferStats:
    """One request's KV transfer: `seconds` on the wire (sum over its frames), `exposed_s` the part
    after the prefill finished (what the transfer adds to the request's time to its second token)."""

    request_id: str
    nbytes: int
    seconds: float
    frames: int = 1
    exposed_s: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(slots=True)
class WorkerLoad:
    """A worker's load and counters since it started: what the router ranks by and /metrics shows."""

    worker_id: str
    role: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    kv_cache_usage: float
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    kv_transfers: int = 0  # sent (prefill workers)
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_failures: int = 0
    kv_frames: int = 0  # frames sent: a transfer of several chunks sends several
    kv_recomputes: int = 0  # prompts a decode worker computed itself because their KV did not arrive
    device: str = ""  # where its engine runs: "cpu", "cuda:0"
    failure: str = ""  # why it cannot serve (a failed warm-up); empty when it can
    tokens_per_s: float = 0.0  # tokens its engine computes per second while busy (recent steps); 0: unknown
    seconds_per_request: float = 0.0  # recent requests' time running, first step to end; 0: unknown
    max_num_seqs: int = 0  # requests it runs at once (the rest wait for one of them to end)
    started_at: float = 0.0  # when its process started (Unix time): a restart, or a model loaded again, shows here
    dtype: str = ""  # its weights' and KV cache's dtype ("auto" resolved on its own hardware)
