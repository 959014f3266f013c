"""What a worker reports about itself: its load (what routers rank workers by, and /metrics and
`pdserve status` show), the stats of each KV transfer it sent, and the ticket a decode worker gives
out for a transfer it expects."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class KVTicket:
    """Where a prefill worker sends one request's KV, and the one-time token the decode worker accepts
    its frames with: a peer that can reach the receiver's port but was not given the ticket (it
    travels in Ray calls only) cannot land bytes in a reserved buffer. Printed, it is its address."""

    address: str
    token: str = field(repr=False)
    # The receiver's KV dtype: each worker resolves dtype auto on its own hardware, so a bf16 prefill
    # worker may feed an fp32 decode worker; the sender converts (empty: send as it is).
    dtype: str = ""
    # The name of the receiver's shared-memory segment for the transfer ("" if none): random, not a
    # secret (anyone on its host can list it), and never the token or anything made from it.
    landing: str = ""
    # The prompt's leading blocks the receiver holds already (its prefix cache): the sender sends the
    # blocks after them, numbered from there.
    reused_blocks: int = 0
    # The receiver computes the prompt itself (its uncached part is short): nothing is to be sent.
    local: bool = False

    def __str__(self) -> str:
        return self.address


@dataclass(frozen=True, slots=True)
class PrefixReuse:
    """How a decode worker takes a prompt whose beginning its prefix cache may hold (the router's
    choice, passed with each reservation): `enabled`, it keeps the cached blocks and receives only
    the KV after them; with fewer than `local_prefill_threshold` tokens left uncached it computes
    them itself and no prefill worker is asked (0: never)."""

    enabled: bool = False
    local_prefill_threshold: int = 0


NO_REUSE = PrefixReuse()  # every prompt's KV travels whole


@dataclass(slots=True)
class TransferStats:
    """One request's KV transfer: `seconds` on the wire (sum over its frames), `exposed_s` the part
    after the prefill finished (what the transfer adds to the request's time to its second token)."""

    request_id: str
    nbytes: int
    seconds: float
    frames: int = 1
    exposed_s: float = 0.0
    transport: str = ""  # how the payload travelled: "shm" (same host), "ucx" (UCX's transports), "loopback"

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


# The part of a KV transfer after its prefill finished (`TransferStats.exposed_s`), on the prefill
# worker: what the transfer adds to a request's time to its second token. vLLM's TTFT buckets.
KV_TRANSFER_EXPOSED = "pdserve:kv_transfer_exposed_seconds"
KV_TRANSFER_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


@dataclass(slots=True)
class BucketCounts:
    """A histogram a worker counts and carries in its load, for /metrics to export as it is (Prometheus
    histograms cannot be summed from samples after the fact). `counts[i]` counts the values in bucket
    `i` alone (not cumulative): at most `bounds[i]`, above `bounds[i - 1]`; the last is +Inf's."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0  # the sum of the values observed

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, values at most it) pairs, inf last: a Prometheus histogram's buckets."""
        running, buckets = 0, []
        for bound, count in zip([*self.bounds, float("inf")], self.counts, strict=True):
            running += count
            buckets.append((bound, running))
        return buckets


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
    # Histograms by metric name (vLLM's request phases, iteration tokens; KV transfer times), counted
    # here since it started: the phases are timed where they happen (docs/observability.md).
    histograms: dict[str, BucketCounts] = field(default_factory=dict)
    num_swapped: int = 0  # requests whose KV is swapped out to host memory
    swap_enabled: bool = False  # preemption by swap is on (else preempted requests are recomputed)
    cache_config: dict[str, str] = field(default_factory=dict)  # the engine's CacheConfig, for cache_config_info
    dtype: str = ""  # its weights' dtype ("auto" resolved on its own hardware)
    kv_cache_dtype: str = ""  # its KV cache's: the weights' or an fp8 one (`CacheConfig.kv_cache_dtype`)
    threads: int = 0  # torch threads its engine computed its last step on (they follow the host's load)
    # Requests it holds, whatever their state (running, waiting, reserved for their KV, landed and
    # waiting for a slot): a decode worker's queue is these beyond its running ones.
    num_held: int = 0
    draining: bool = False  # it takes no new requests: it finishes those it holds, then leaves
    # Speculative decoding (vLLM's spec_decode counters), where its engine speculates (num_speculative_tokens > 0):
    # rows verified with drafts, drafts run, drafts accepted, and acceptances by draft position (0 first).
    num_speculative_tokens: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: list[int] = field(default_factory=list)
    # The host KV tier, where its engine has one (num_host_kv_blocks > 0): its blocks and those holding KV,
    # prompt tokens looked up there (past the device pool's hits) and found, blocks moved out and back in.
    num_host_kv_blocks: int = 0
    host_kv_used_blocks: int = 0
    host_kv_queries: int = 0
    host_kv_hits: int = 0
    host_kv_offloaded: int = 0
    host_kv_promoted: int = 0
    kv_transfer_blocks: int = 0  # KV blocks sent (prefill workers)
    # Decode workers: prompt tokens whose KV their prefix cache held when the prompt came (never sent),
    # and prompts they computed themselves because the part not cached was short (no prefill worker).
    decode_reused_prompt_tokens: int = 0
    local_prefills: int = 0
    # Prefix blocks fetched from peers instead of computed (prefill workers), and sent to peers fetching them.
    prefix_blocks_fetched: int = 0
    prefix_blocks_offered: int = 0
