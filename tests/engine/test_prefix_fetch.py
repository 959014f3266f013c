"""A prefill engine takes the beginning of a prompt's KV from a peer engine that caches it, instead of
computing it: the peer pins and sends its blocks, the fetcher lands them in blocks of its own and
caches them under the same hashes, and the prompt's prefill finds them there. Tokens equal the engine
alone's; every block comes back, whichever step fails or is never taken."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.engine.test_disaggregation import drain, make_engine
from tests.engine.test_engine_outputs import GREEDY, assert_pool_whole
from tests.helpers import fp32_model

DOCUMENT = list(range(100, 141))  # 41 tokens: ten full blocks of 4 and one token


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


def fetch(donor: LLMEngine, fetcher: LLMEngine, prompt: list[int], first_block: int, stop_block: int,
          fetch_id: str = "fetch", domain: str = "") -> int:
    """The whole exchange, as the router drives it: blocks fetched (0: none offered or no room)."""
    offered = donor.offer_prefix(fetch_id, prompt, domain, first_block, stop_block)
    if not offered:
        return 0
    landing = fetcher.reserve_fetch(fetch_id, prompt, domain, first_block, offered)
    if landing is None:
        donor.release_prefix(fetch_id)
        return 0
    data = donor.export_offer(fetch_id)
    fetcher.land_fetch(fetch_id, data.clone())
    return offered


def run(engine: LLMEngine, prompt: list[int], request_id: str, params: SamplingParams = GREEDY) -> tuple[
        list[int], int]:
    """Tokens and prompt tokens found cached."""
    engine.add_request(prompt, params, request_id=request_id)
    cached = engine.scheduler.requests[request_id]
    tokens = drain(engine)[request_id]
    return tokens, cached.num_cached_tokens


def test_a_fetched_prefix_is_found_cached_and_gives_the_engine_alones_tokens(checkpoint: Path) -> None:
    alone, donor, fetcher = make_engine(checkpoint), make_engine(checkpoint), make_engine(checkpoint)
    run(donor, DOCUMENT, "donor")
    prompt = DOCUMENT + [7, 8, 9, 10, 11]  # 46 tokens: eleven full blocks, ten of them the donor's
    assert fetch(donor, fetcher, prompt, 0, len(prompt) // 4) == 10  # what it holds, no more
    fetched_ids = [fetcher.kv_cache.pool.lookup(h).block_id for h in fetcher._chain(prompt, "", 10)]
    donor_ids = [donor.kv_cache.pool.lookup(h).block_id for h in donor._chain(prompt, "", 10)]
    assert torch.equal(fetcher.runner.read_blocks(fetched_ids), donor.runner.read_blocks(donor_ids))
    fetcher.release_prefix("fetch")
    tokens, cached = run(fetcher, prompt, "request")
    assert cached == 40
    assert tokens == alone.generate([prompt], GREEDY)[0].token_ids
    assert fetcher.stats().num_prefix_blocks_fetched == 10 and donor.stats().num_prefix_blocks_offered == 10
    for engine in (donor, fetcher):
        assert_pool_whole(engine)


def test_a_fetch_after_the_fetchers_own_blocks_continues_its_chain(checkpoint: Path) -> None:
    alone, donor, fetcher = make_engine(checkpoint), make_engine(checkpoint), make_engine(checkpoint)
    run(donor, DOCUMENT, "donor")
    run(fetcher, DOCUMENT[:17], "own")  # four full blocks of its own
    assert fetch(donor, fetcher, DOCUMENT, 4, 10) == 6
    fetcher.release_prefix("fetch")
    tokens, cached = run(fetcher, DOCUMENT, "request")
    assert cached == 40
    assert tokens == alone.generate([DOCUMENT], GREEDY)[0].token_ids
    assert_pool_whole(fetcher)


def test_the_fetched_blocks_stay_pinned_until_released(checkpoint: Path) -> None:
    donor, fetcher = make_engine(checkpoint), make_engine(checkpoint, num_blocks=16)
    run(donor, DOCUMENT, "donor")
    fetch(donor, fetcher, DOCUMENT, 0, 10)
    # A request that needs every other block (19 + 4 tokens) evicts none of the ten pinned ones.
    run(fetcher, list(range(200, 219)), "other", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(fetcher.kv_cache.pool.cached_run(fetcher._chain(DOCUMENT, "", 10))) == 10
    assert fetcher.kv_cache.pool.num_free_blocks == 6  # the pin still owns the ten
    fetcher.release_prefix("fetch")
    assert_pool_whole(fetcher)


def test_nothing_is_fetched_where_it_could_not_be_found_or_has_no_room(checkpoint: Path) -> None:
    donor, fetcher = make_engine(checkpoint), make_engine(checkpoint, num_blocks=6)
    assert fetch(donor, fetcher, DOCUMENT, 0, 10) == 0  # the donor holds nothing
    run(donor, DOCUMENT, "donor")
    assert fetch(donor, fetcher, DOCUMENT, 2, 10, "gap") == 0  # the fetcher lacks blocks 0 and 1
    assert fetch(donor, fetcher, DOCUMENT, 0, 10, "full") == 0  # ten blocks do not fit in six
    # Another cache domain names other blocks: the donor's are no hit for it.
    assert donor.offer_prefix("domain", DOCUMENT, "tenant-b", 0, 10) == 0
    for engine in (donor, fetcher):
        assert_pool_whole(engine)
        assert not engine.prefix_pins.pins


def test_a_fetch_whose_kv_never_lands_leaves_no_block_cached_or_held(checkpoint: Path) -> None:
    donor, fetcher = make_engine(checkpoint), make_engine(checkpoint)
    run(donor, DOCUMENT, "donor")
    assert donor.offer_prefix("fetch", DOCUMENT, "", 0, 10) == 10
    assert fetcher.reserve_fetch("fetch", DOCUMENT, "", 0, 10) is not None
    donor.release_prefix("fetch")  # the send failed
    fetcher.release_prefix("fetch")
    assert not fetcher.kv_cache.pool.cached  # no block claims a hash its KV never came for
    for engine in (donor, fetcher):
        assert_pool_whole(engine)


def test_pins_whose_lease_ran_out_are_released_by_the_next_step(checkpoint: Path) -> None:
    donor, fetcher = make_engine(checkpoint), make_engine(checkpoint)
    run(donor, DOCUMENT, "donor")
    assert donor.offer_prefix("fetch", DOCUMENT, "", 0, 10, lease_s=0.0) == 10
    assert fetcher.reserve_fetch("fetch", DOCUMENT, "", 0, 10, lease_s=0.0) is not None
    for engine in (donor, fetcher):
        engine.step()
        assert not engine.prefix_pins.pins
        assert_pool_whole(engine)


def test_blocks_in_the_host_tier_are_offered_and_lead_a_fetch_as_the_routers_index_says(checkpoint: Path) -> None:
    """A worker's published blocks include its host tier's: a donor promotes those that continue its
    pool's run before it offers, and a fetcher those that lead the fetched blocks."""
    def tiered() -> LLMEngine:
        return LLMEngine(EngineConfig(model=fp32_model(checkpoint),
                                      cache=CacheConfig(block_size=4, num_blocks=16, num_host_kv_blocks=64)))

    alone, donor, fetcher = make_engine(checkpoint), tiered(), tiered()
    run(donor, DOCUMENT, "donor")
    run(fetcher, DOCUMENT[:17], "own")
    for engine in (donor, fetcher):  # a prompt of every block of the pool: the earlier ones go to the tier
        run(engine, list(range(200, 261)), "evicting", SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert not donor.kv_cache.pool.cached_run(donor._chain(DOCUMENT, "", 10))  # none left in the pool
    assert fetch(donor, fetcher, DOCUMENT, 4, 10) == 6
    fetcher.release_prefix("fetch")
    short = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)  # 49 tokens fit the pool of 16 blocks
    tokens, cached = run(fetcher, DOCUMENT, "request", short)
    assert cached == 40 and tokens == alone.generate([DOCUMENT], short)[0].token_ids
    for engine in (donor, fetcher):
        assert_pool_whole(engine)


def test_promoting_a_prefixs_tail_from_the_host_tier_evicts_none_of_its_head(checkpoint: Path) -> None:
    """The pool evicts a prompt's blocks tail first: its head stays in the pool, its tail goes to the
    tier. Offering the whole prefix promotes the tail into fresh blocks, which must not be taken by
    evicting the head it continues (free and first in line)."""
    donor = LLMEngine(EngineConfig(model=fp32_model(checkpoint),
                                   cache=CacheConfig(block_size=4, num_blocks=16, num_host_kv_blocks=64)))
    run(donor, DOCUMENT, "donor", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # 13 blocks
    run(donor, list(range(200, 236)), "evicting", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    chain = donor._chain(DOCUMENT, "", 10)
    assert len(donor.kv_cache.pool.cached_run(chain)) == 6  # blocks 6-9 went to the tier
    assert donor.offer_prefix("fetch", DOCUMENT, "", 0, 10) == 10
    donor.release_prefix("fetch")
    assert_pool_whole(donor)
