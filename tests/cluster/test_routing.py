"""The router's choices: decode workers by load, prefill workers by prompt work and cached prefix."""

from __future__ import annotations

from cluster.actors import Router
from cluster.routing import PrefixIndex, decode_rank, prefill_cost, prefix_hashes
from cluster.worker import WorkerLoad

PROMPT = list(range(100, 140))  # 40 tokens: 2 full blocks of 16


def test_prefix_hashes_are_chained_per_full_block() -> None:
    hashes = prefix_hashes(PROMPT, 16)
    assert len(hashes) == 2
    assert prefix_hashes(PROMPT[:32] + [1, 2, 3], 16) == hashes  # same full blocks, same hashes
    changed_first = prefix_hashes([7] + PROMPT[1:], 16)
    assert changed_first[0] != hashes[0] and changed_first[1] != hashes[1]  # a block's hash covers its prefix


def test_prefix_index_counts_leading_blocks_and_forgets_the_oldest() -> None:
    index = PrefixIndex(capacity=3)
    hashes = prefix_hashes(PROMPT + PROMPT, 16)  # 5 blocks
    index.record("a", hashes[:2])
    assert index.overlap("a", hashes) == 2 and index.overlap("b", hashes) == 0
    index.record("a", [11, 12])  # capacity 3: the first block's hash goes
    assert index.overlap("a", hashes) == 0
    index.forget("a")
    assert index.overlap("a", [12]) == 0


def test_prefill_prefers_the_worker_with_the_prefix_unless_its_queue_outweighs_it() -> None:
    assert prefill_cost(queued_tokens=0, prompt_tokens=40, cached_blocks=2, block_size=16) == 8
    router = Router(prefill=["p0", "p1"], decode=[], mode="disaggregated", lease_s=1.0, block_size=16)
    first, _ = router._pick_prefill(PROMPT)  # type: ignore[misc]
    again, _ = router._pick_prefill(PROMPT)  # type: ignore[misc]
    assert again == first and router.decisions["prefix_hits"] == 1
    router.queued_tokens[id(first)] = 1000  # busy with long prompts: the cached prefix is not worth the wait
    other, _ = router._pick_prefill(PROMPT)  # type: ignore[misc]
    assert other != first
    router.dead.add(id(other))
    router.dead.add(id(first))
    assert router._pick_prefill(PROMPT) is None  # none alive: the decode worker will recompute


def test_decode_workers_rank_by_requests_then_queue_then_free_blocks() -> None:
    def load(waiting: int, free: int) -> WorkerLoad:
        return WorkerLoad("d", "decode", 0, waiting, free, 100, 1 - free / 100)

    ranks = {name: decode_rank(*args) for name, args in {
        "idle": (0, load(0, 90)), "fuller": (0, load(0, 10)), "queued": (0, load(3, 90)), "busy": (2, load(0, 99)),
        "unpolled": (1, None)}.items()}
    assert sorted(ranks, key=ranks.__getitem__) == ["idle", "fuller", "queued", "unpolled", "busy"]
