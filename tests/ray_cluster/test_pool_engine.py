"""Per-pool engine limits: a pool's `engine:` overrides merged over the cluster's `engine:` section,
checked with errors that name the field, and what each pool's workers are made with."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.ray_cluster.config import cluster_config_from, load_cluster_config
from cluster.ray_cluster.worker_pool import pool_ranks, worker_arguments, worker_engine, worker_spec

CONFIG = {"engine": {"max_num_seqs": 64, "max_num_batched_tokens": 1024, "kv_cache_memory_gb": 0.5},
          "prefill": {"engine": {"max_num_batched_tokens": 4096}},
          "decode": {"engine": {"max_num_seqs": 8, "kv_cache_memory_gb": 2.0, "enable_prefix_caching": False}}}


def test_each_pool_takes_its_overrides_over_the_shared_engine_section() -> None:
    config = cluster_config_from(CONFIG)
    prefill, decode = config.engine_for("prefill"), config.engine_for("decode")
    assert (prefill.scheduler.max_num_batched_tokens, prefill.scheduler.max_num_seqs) == (4096, 64)
    assert prefill.cache.kv_cache_memory_gb == 0.5 and prefill.cache.enable_prefix_caching
    assert (decode.scheduler.max_num_batched_tokens, decode.scheduler.max_num_seqs) == (1024, 8)
    assert decode.cache.kv_cache_memory_gb == 2.0 and not decode.cache.enable_prefix_caching
    assert decode.model == prefill.model == config.engine.model  # one model, one KV layout
    assert config.engine_for("colocated") == decode  # a colocated pool is the decode pool's
    plain = cluster_config_from({"engine": {"max_num_seqs": 64}})
    assert plain.engine_for("prefill") == plain.engine_for("decode") == plain.engine


def test_the_workers_of_each_pool_are_made_with_its_engine() -> None:
    config = cluster_config_from(CONFIG)
    decode_spec = worker_spec(config, "decode", config.decode, 0.0)
    prefill_spec = worker_spec(config, "prefill", config.prefill, 0.0)
    assert decode_spec[1].scheduler.max_num_seqs == 8 and prefill_spec[1].scheduler.max_num_seqs == 64
    made = {role: worker_arguments(config, "c1", role, 1, 0.0) for role in ("prefill", "decode")}
    assert made["decode"]["engine_config"] == config.engine_for("decode") != made["prefill"]["engine_config"]
    assert made["decode"]["spec"] == decode_spec and made["decode"]["address"] == "pdserve-c1-decode-1"


@pytest.mark.parametrize(("overrides", "message"), [
    ({"decode": {"engine": {"max_num_seqz": 4}}}, r"decode\.engine\.max_num_seqz: unknown engine key"),
    ({"prefill": {"engine": {"block_size": 32}}},
     r"prefill\.engine\.block_size cannot differ between pools"),
    ({"decode": {"engine": {"model": "other"}}}, r"decode\.engine\.model cannot differ between pools"),
    ({"decode": {"engine": {"max_num_seqs": 0}}}, r"decode\.engine: .*max_num_seqs"),
    ({"decode": {"engine": ["max_num_seqs", 4]}}, r"decode\.engine must be a mapping"),
])
def test_a_bad_pool_override_names_its_field(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cluster_config_from(overrides)


def test_each_pool_takes_its_own_tensor_parallel_size_from_the_file_and_the_command_line(tmp_path: Path) -> None:
    from cluster.cli import build_parser, cluster_overrides

    path = tmp_path / "cluster.yaml"
    path.write_text("engine: {tensor_parallel_size: 2}\nprefill: {engine: {max_num_batched_tokens: 512}}\n")
    args = build_parser().parse_args(["serve", "--decode-tensor-parallel-size", "1", "--num-prefill", "2"])
    config = load_cluster_config(path, cluster_overrides(args))
    assert (pool_ranks(config, "prefill"), pool_ranks(config, "decode")) == (2, 1)
    assert config.engine_for("prefill").scheduler.max_num_batched_tokens == 512  # merged, not replaced
    assert config.prefill.replicas == 2
    every_pool = build_parser().parse_args(["serve", "--tensor-parallel-size", "2"])
    config = load_cluster_config(None, cluster_overrides(every_pool))
    assert (pool_ranks(config, "prefill"), pool_ranks(config, "decode")) == (2, 2)


def test_ranks_on_a_shared_gpu_are_refused() -> None:
    config = cluster_config_from({"decode": {"engine": {"tensor_parallel_size": 2}}})
    with pytest.raises(ValueError, match=r"decode: tensor_parallel_size 2 with num_gpus 0.5: each rank computes "
                                         r"on a GPU of its own"):
        worker_engine(config, "decode", 0.5)
    assert worker_engine(config, "decode", 1.0).model.tensor_parallel_size == 2


def test_speculation_is_an_engine_key_a_pool_may_set_alone() -> None:
    """vLLM's `speculative_config` mapping in `engine:`, on the decode pool alone, or from `pdserve serve
    --speculative-config` (for every pool); `generate`'s flag builds the same engine config."""
    from cluster.cli import build_parser, cluster_overrides, engine_config
    from cluster.ray_cluster.config import load_cluster_config

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    config = cluster_config_from({"decode": {"engine": {"speculative_config": spec}}})
    decode, prefill = config.engine_for("decode").speculative, config.engine_for("prefill").speculative
    assert (decode.method, decode.num_speculative_tokens, decode.prompt_lookup_min) == ("ngram", 3, 4)
    assert not prefill.enabled and not cluster_config_from({}).engine.speculative.enabled
    flag = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    served = load_cluster_config(None, cluster_overrides(build_parser().parse_args(["serve", *flag])))
    assert served.engine_for("decode").speculative.num_speculative_tokens == 2
    generate = engine_config(build_parser().parse_args(["generate", "hi", *flag]))
    assert generate.speculative == served.engine.speculative
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        cluster_config_from({"engine": {"speculative_config": {"method": "ngram"}}})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", '{"method": "medusa"}'])


def test_the_host_kv_tier_reaches_each_pools_engines_from_the_flags_and_the_yaml() -> None:
    from cluster.cli import build_parser, cluster_overrides, engine_config

    args = build_parser().parse_args(["serve", "--host-kv-cache-gb", "2"])
    config = load_cluster_config(None, {**cluster_overrides(args), "decode": {"engine": {
        "num_host_kv_blocks": 64, "host_kv_disk_dir": "/mnt/kv"}}})
    assert config.engine_for("prefill").cache.host_kv_cache_gb == 2.0
    assert config.engine_for("decode").cache.num_host_kv_blocks == 64
    assert (config.engine_for("prefill").cache.host_kv_disk_dir, config.engine_for("decode").cache.host_kv_disk_dir) \
        == ("", "/mnt/kv")
    on_disk = build_parser().parse_args(["serve", "--host-kv-cache-gb", "8", "--host-kv-disk-dir", "/mnt/kv"])
    assert load_cluster_config(None, cluster_overrides(on_disk)).engine.cache.host_kv_disk_dir == "/mnt/kv"
    assert not load_cluster_config(None, {}).engine.cache.host_kv_enabled  # off unless asked
    generate = build_parser().parse_args(["generate", "hi", "--num-host-kv-blocks", "32"])
    assert engine_config(generate).cache.num_host_kv_blocks == 32
    with pytest.raises(ValueError, match="host_kv_cache_gb must be > 0"):
        cluster_config_from({"engine": {"host_kv_cache_gb": -1}})


def test_the_prefix_reuse_flags_reach_the_cluster_config(tmp_path: Path) -> None:
    from cluster.cli import build_parser, cluster_overrides

    path = tmp_path / "cluster.yaml"
    path.write_text("local_prefill_threshold: 32\n")
    assert load_cluster_config(path, {}).local_prefill_threshold == 32
    args = build_parser().parse_args(["serve", "--local-prefill-threshold", "64", "--no-decode-prefix-reuse",
                                      "--prefix-fetch"])
    config = load_cluster_config(path, cluster_overrides(args))
    assert (config.local_prefill_threshold, config.decode_prefix_reuse, config.prefix_fetch) == (64, False, True)
    defaults = load_cluster_config(None, cluster_overrides(build_parser().parse_args(["serve"])))
    assert (defaults.local_prefill_threshold, defaults.decode_prefix_reuse, defaults.prefix_fetch) == (0, True, False)
    with pytest.raises(ValueError, match="local_prefill_threshold must be >= 0"):
        cluster_config_from({"local_prefill_threshold": -1})
