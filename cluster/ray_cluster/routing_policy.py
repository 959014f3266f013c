"""How the router picks workers: by load, and prefill workers also by the prompt prefix they hold.

Decode workers are ranked by requests the router has in flight there, then their waiting queue and
free KV blocks as last polled (`WorkerLoad`, every `LOAD_POLL_S`). A prefill worker is ranked by the
prompt tokens it still has to compute: those of the prompts in flight there less their cached
prefixes, plus this prompt less the prefix it has cached. Without Redis the router remembers which
block-aligned prompt prefixes it sent to which worker (bounded, oldest forgotten first), as SGLang's
cache-aware router does, without asking the workers; with Redis, the workers publish the blocks they
cache and evict (`cluster.state.interface`), and every router replica matches prompts against that.
"""

from __future__ import annotations

from cluster.common.loads import WorkerLoad

LOAD_POLL_S = 0.5
POLL_TIMEOUT_S = 5.0  # a worker that takes longer to tell its load keeps the last one (it may be restarting)


def decode_rank(in_flight: int, load: WorkerLoad | None) -> tuple[int, int, int]:
    """Lower is better: fewer requests here, fewer waiting, more free blocks."""
    if load is None:
        return in_flight, 0, 0
    return in_flight, load.num_waiting, -load.num_free_blocks


def prefill_cost(queued_tokens: int, prompt_tokens: int, cached_blocks: int, block_size: int) -> int:
    """Prompt tokens the worker computes before this one is done (its queue, then the uncached part)."""
    return queued_tokens + max(prompt_tokens - cached_blocks * block_size, 0)
