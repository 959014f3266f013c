"""Only the positions that sample go through the lm_head: a prompt chunk that does not finish its
prompt samples nothing, a finished prompt samples at its last position, a decode at its one token."""

from __future__ import annotations

from pathlib import Path

import torch

from cluster.common.sampling_params import SamplingParams
from cluster.engine.block_pool import BlockPool
from cluster.engine.config import SchedulerConfig
from cluster.engine.kv_cache_manager import KVCacheManager
from cluster.engine.request import Request
from cluster.engine.scheduler import Scheduler
from cluster.model.registry import architecture_config
from cluster.model.runner import ModelRunner
from cluster.weights.loader import iterate_safetensors, load_hf_config
from cluster.weights.synthetic import build_random_llama


def test_lm_head_sees_only_the_rows_that_sample(tmp_path: Path) -> None:
    path = build_random_llama(tmp_path)
    arch = architecture_config(load_hf_config(path))
    runner = ModelRunner(arch, iterate_safetensors(path), dtype="float32", device="cpu", attention_backend="torch",
                         max_model_len=128, block_size=4, num_blocks=64)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=24), KVCacheManager(BlockPool(64), 4),
                          max_model_len=128)
    rows_seen: list[int] = []
    runner.model.lm_head.register_forward_hook(lambda module, args, out: rows_seen.append(args[0].shape[0]))
    greedy = SamplingParams(max_tokens=4, temperature=0)
    scheduler.add_request(Request("short", list(range(3, 13)), greedy, eos_token_ids=()))
    scheduler.add_request(Request("long", list(range(3, 33)), greedy, eos_token_ids=()))
    output = scheduler.schedule()  # "short" whole (10 tokens), "long" a chunk of 14: one row samples
    batch = runner.build_batch(output.scheduled)
    assert batch.input_ids.shape[0] == 24
    assert [batch.rows[row].request.request_id for row in batch.sample_rows] == ["short"]
    result = runner.execute(output)
    assert rows_seen == [1] and list(result.sampled) == ["short"]
    scheduler.update_from_output(output, result.sampled)
    output = scheduler.schedule()  # "short" decodes (1 token), "long" finishes its prompt (16 tokens)
    result = runner.execute(output)
    assert rows_seen == [1, 2] and sorted(result.sampled) == ["long", "short"]
    with torch.inference_mode():  # the sampled rows are the last positions of their rows
        batch = runner.build_batch(output.scheduled)
        assert batch.logits_indices.tolist() == [index - 1 for index in batch.metadata.query_start_list[1:]]
