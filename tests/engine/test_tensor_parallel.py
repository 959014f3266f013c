"""A tensor-parallel engine (ranks in processes of their own, gloo on the CPU) computes the model alone's tokens.

The model has 4 attention heads and 2 KV heads, so at tensor_parallel_size 2 each rank holds 2 query
heads and 1 KV head; prompts run in chunks under a small token budget, then decode. Greedy tokens
must equal the one-rank engine's and transformers' (teacher-forced) on the same random weights.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cluster.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.engine.test_disaggregation import drain, move_kv
from tests.engine.test_engine_outputs import GREEDY, PROMPTS, assert_pool_whole, run_staggered
from tests.helpers import fp32_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"), num_layers=2, hidden=64, heads=4, kv_heads=2)


def make_engine(path: Path, tensor_parallel_size: int, *, budget: int = 2048, num_blocks: int = 256,  # noqa: PLR0913
                mode: str = "recompute", num_host_kv_blocks: int = 0, host_kv_disk_dir: str = "") -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=fp32_model(path, tensor_parallel_size=tensor_parallel_size, device="cpu"),  # gloo, any host
        cache=CacheConfig(block_size=4, num_blocks=num_blocks, num_host_kv_blocks=num_host_kv_blocks,
                          host_kv_disk_dir=host_kv_disk_dir),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, preemption_mode=mode)))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> list[list[int]]:
    engine = make_engine(checkpoint, 1)
    return [engine.generate([prompt], GREEDY)[0].token_ids for prompt in PROMPTS]


@pytest.fixture(scope="module")
def tp_engine(checkpoint: Path) -> Iterator[LLMEngine]:
    """Two ranks; a budget of 5 tokens cuts every prompt but the shortest into chunks."""
    engine = make_engine(checkpoint, 2, budget=5)
    yield engine
    engine.close()


def test_two_ranks_give_one_ranks_tokens_over_prefill_chunks_and_decodes(
        tp_engine: LLMEngine, reference: list[list[int]]) -> None:
    assert run_staggered(tp_engine, PROMPTS) == reference
    assert_pool_whole(tp_engine)


def test_two_ranks_give_transformers_tokens(tp_engine: LLMEngine, checkpoint: Path) -> None:
    import transformers

    oracle = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for prompt in PROMPTS[:3]:
        tokens = tp_engine.generate([prompt], GREEDY)[0].token_ids
        with torch.no_grad():
            logits = oracle(torch.tensor([prompt + tokens[:-1]])).logits[0]
        assert logits[len(prompt) - 1:].argmax(dim=-1).tolist() == tokens


def test_each_rank_holds_its_share_of_the_heads(tp_engine: LLMEngine) -> None:
    attention: Any = tp_engine.runner.model.model.layers[0].self_attn
    assert (attention.num_heads, attention.num_kv_heads) == (2, 1)
    assert tp_engine.runner.kv_caches[0].shape[3] == 1  # one KV head of the model's two
    assert len(tp_engine.ranks.processes) == 1 and tp_engine.ranks.processes[0].is_alive()  # type: ignore[union-attr]


def test_swap_preemption_moves_every_ranks_blocks(checkpoint: Path, reference: list[list[int]]) -> None:
    engine = make_engine(checkpoint, 2, num_blocks=24, mode="swap")
    try:
        assert run_staggered(engine, PROMPTS) == reference
        assert engine.scheduler.num_preemptions > 0
        assert_pool_whole(engine)
    finally:
        engine.close()


def test_every_rank_moves_its_heads_to_and_from_the_host_kv_tier(checkpoint: Path, tmp_path: Path) -> None:
    """A working set of 4x the pool through two ranks: each rank offloads and promotes its own heads'
    share of a block (in a step, and outside one when a reservation evicts); one rank's tokens and hits.
    On disk: each rank maps a file of its own (the tier's storage is the only difference)."""
    from tests.engine.test_host_kv_tier import WORKLOAD, run_in_turn, tier_engine

    reference, reference_cached = run_in_turn(tier_engine(checkpoint, num_blocks=16, num_host_kv_blocks=64))
    engine = make_engine(checkpoint, 2, num_blocks=16, num_host_kv_blocks=64, host_kv_disk_dir=str(tmp_path))
    try:
        assert run_in_turn(engine) == (reference, reference_cached)
        assert reference_cached[len(WORKLOAD) // 2:] == [20] * (len(WORKLOAD) // 2)  # every second turn hit
        prompt = WORKLOAD[0] + [7, 8, 9]
        block_ids = engine.reserve_remote(prompt, GREEDY, request_id="remote")  # evicts, copies at once
        assert block_ids is not None
        engine.abort("remote")
        assert_pool_whole(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("size", [3, 4])
def test_a_size_that_does_not_split_the_heads_is_refused(checkpoint: Path, size: int) -> None:
    """3 divides neither 4 heads nor 2 KV heads; 4 divides the heads but not the KV heads."""
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=rf"tensor_parallel_size {size} must divide .*4 attention heads, "
                                         r"2 KV heads.*sizes that do: \[1, 2\]"):
        make_engine(checkpoint, size)
    assert set(multiprocessing.active_children()) == before  # refused before any rank started


def test_close_stops_every_rank(checkpoint: Path) -> None:
    engine = make_engine(checkpoint, 2)
    processes = list(engine.ranks.processes)  # type: ignore[union-attr]
    engine.close()
    assert not any(process.is_alive() for process in processes)
    assert [process.exitcode for process in processes] == [0]


KILLED_ENGINE = """
import sys, time
from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig
from cluster.engine.llm_engine import LLMEngine
engine = LLMEngine(EngineConfig(model=ModelConfig(model=sys.argv[1], dtype="float32", device="cpu",
                                                  tensor_parallel_size=2),
                                cache=CacheConfig(block_size=4, num_blocks=64)))
print(engine.ranks.processes[0].pid, flush=True)
time.sleep(600)
"""


def test_a_killed_engine_leaves_no_rank_behind(checkpoint: Path) -> None:
    """SIGKILL runs no cleanup in rank 0's process: its ranks see their pipe close and end themselves."""
    import os
    import signal
    import subprocess
    import sys
    import time

    engine = subprocess.Popen([sys.executable, "-c", KILLED_ENGINE, str(checkpoint)], stdout=subprocess.PIPE,
                              text=True, env=os.environ)
    rank_pid = 0
    try:
        assert engine.stdout is not None
        rank_pid = int(engine.stdout.readline())
        engine.send_signal(signal.SIGKILL)
        engine.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and os.path.exists(f"/proc/{rank_pid}") and not is_zombie(rank_pid):
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{rank_pid}") or is_zombie(rank_pid)
    finally:
        engine.kill()
        if rank_pid and not is_zombie(rank_pid):  # the test failed: end what it left
            os.kill(rank_pid, signal.SIGKILL)


def is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_engine_commands_take_the_size() -> None:
    from cluster.cli import build_parser, engine_config

    for command in (["generate", "hello"], ["chat"], ["bench"]):
        args = build_parser().parse_args([*command, "--tensor-parallel-size", "2"])
        assert engine_config(args).model.tensor_parallel_size == 2


@pytest.mark.parametrize("sizes", [(2, 1), (1, 2)], ids=["prefill-2-decode-1", "prefill-1-decode-2"])
def test_kv_moves_between_engines_of_other_sizes(checkpoint: Path, tp_engine: LLMEngine, reference: list[list[int]],
                                                 sizes: tuple[int, int]) -> None:
    """What an engine exports holds every KV head whatever its ranks (rank 0 gathers them), and what one
    imports lands on each rank as its own heads: a prompt prefilled on two ranks decodes on one, and back."""
    single = make_engine(checkpoint, 1)
    prefill, decode = (tp_engine, single) if sizes == (2, 1) else (single, tp_engine)
    for index, prompt in enumerate(PROMPTS):
        request_id = f"moved-{sizes}-{index}"
        first, exported = move_kv(prefill, decode, prompt, request_id)  # landed bit for bit, every head
        assert exported.shape[4] == 2  # both of the model's KV heads
        decode.admit_remote(request_id, first)
    finished = drain(decode)
    assert [finished[f"moved-{sizes}-{index}"] for index in range(len(PROMPTS))] == reference
    assert_pool_whole(prefill)
    assert_pool_whole(decode)


# A dense layer then sparse ones (top-2 of 4 experts, each split between the ranks), Mixtral's w1/w3/w2
# names, and Gemma 2's soft caps and sliding local layers.
OTHER_ARCHITECTURES = {
    "qwen3_moe": dict(architecture="qwen3_moe", num_layers=3, head_dim=32,
                      moe=dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0])),
    "mixtral": dict(architecture="mixtral", moe=dict(num_local_experts=4, num_experts_per_tok=2)),
    "gemma2": dict(architecture="gemma2", num_layers=4, sliding_window=6, tie_word_embeddings=True,
                   extra_config={"attn_logit_softcapping": 3.0, "final_logit_softcapping": 4.0,
                                 "query_pre_attn_scalar": 24}),
}


@pytest.mark.parametrize("name", list(OTHER_ARCHITECTURES))
def test_two_ranks_split_experts_and_gemma_as_they_split_llama(tmp_path: Path, name: str) -> None:
    from cluster.weights.synthetic import build_random_llama, build_tiny_tokenizer

    path = build_random_llama(tmp_path / name, **OTHER_ARCHITECTURES[name])  # type: ignore[arg-type]
    build_tiny_tokenizer(path)
    expected = [make_engine(path, 1).generate([prompt], GREEDY)[0].token_ids for prompt in PROMPTS]
    engine = make_engine(path, 2, budget=5)
    try:
        assert run_staggered(engine, PROMPTS) == expected
        assert_pool_whole(engine)
    finally:
        engine.close()


def test_stacked_experts_split_as_their_per_expert_tensors_do() -> None:
    """A checkpoint may store each layer's experts stacked ([experts, 2 * inter, hidden] gate rows first,
    [experts, hidden, inter]); a rank's slice equals the stack of its per-expert slices."""
    from cluster.model.registry import architecture_config
    from cluster.model.tensor_parallel import shard_tensor

    arch = architecture_config({"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 320, "hidden_size": 64,
                                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32})
    gate, up, down = torch.randn(4, 32, 64), torch.randn(4, 32, 64), torch.randn(4, 64, 32)
    for rank in (0, 1):
        def each(projection: str, weights: torch.Tensor, rank: int = rank) -> torch.Tensor:
            return torch.stack([shard_tensor(f"model.layers.1.mlp.experts.{e}.{projection}.weight", weights[e], arch,
                                             rank, 2) for e in range(4)])

        stacked = shard_tensor("model.layers.1.mlp.experts.gate_up_proj", torch.cat([gate, up], dim=1), arch, rank, 2)
        assert torch.equal(stacked, torch.cat([each("gate_proj", gate), each("up_proj", up)], dim=1))
        assert torch.equal(shard_tensor("model.layers.1.mlp.experts.down_proj", down, arch, rank, 2),
                           each("down_proj", down))
        assert each("down_proj", down).shape == (4, 64, 16)


def test_a_size_that_does_not_split_the_experts_is_refused() -> None:
    from cluster.model.registry import architecture_config
    from cluster.model.tensor_parallel import check_tensor_parallel

    arch = architecture_config({"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 320, "hidden_size": 64,
                                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "num_key_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 34})
    with pytest.raises(ValueError, match="tensor_parallel_size 4 must divide .*34 expert intermediate size"):
        check_tensor_parallel(arch, 4)
    check_tensor_parallel(arch, 2)
