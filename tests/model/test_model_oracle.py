"""Logits of our model over the paged cache against transformers on the same random weights."""

from __future__ import annotations

from pathlib import Path

import pytest
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

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

CASES = {
    "llama-gqa": dict(num_heads=4, num_kv_heads=2),
    "llama-mha-tied-llama3-rope-bias": dict(num_heads=4, num_kv_heads=4, tie_word_embeddings=True,
                                            rope_scaling=LLAMA3_ROPE, qkv_bias=True),
    "qwen2-gqa-qkv-bias": dict(architecture="qwen2", num_heads=6, num_kv_heads=2, hidden_size=96),
    # Per-head query and key norms, and a head_dim apart from hidden / heads (as Qwen3's 128).
    "qwen3-qk-norm-head-dim": dict(architecture="qwen3", num_heads=4, num_kv_heads=2, hidden_size=64, head_dim=32),
    # q/k/v and gate/up stored fused; a window wider than every sequence here.
    "phi3-fused-in-the-checkpoint": dict(architecture="phi3", num_heads=4, num_kv_heads=2, sliding_window=64),
    # A window wider than every sequence here: transformers' sliding mask changes nothing, nor may ours.
    "mistral-gqa-window-past-the-context": dict(architecture="mistral", num_heads=4, num_kv_heads=2,
                                                sliding_window=64),
    # Layer 0 dense (`mlp_only_layers`), layers 1 and 2 sparse: top-2 of 4 experts, weights renormalized.
    "qwen3-moe-dense-and-sparse-renormalized": dict(
        architecture="qwen3_moe", num_layers=3, head_dim=32,
        moe=dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0])),
    # Every other layer sparse (`decoder_sparse_step`): top-2 of 8, the softmax's own weights.
    "qwen3-moe-sparse-step-softmax-weights": dict(
        architecture="qwen3_moe", num_layers=4,
        moe=dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=2)),
    # `block_sparse_moe` with w1/w2/w3 in the checkpoint; top-2 of 8, renormalized.
    "mixtral-top2-of-8": dict(architecture="mixtral", num_heads=4, num_kv_heads=2,
                              moe=dict(num_local_experts=8, num_experts_per_tok=2)),
}


def make_parts(path: Path, budget: int, block_size: int = 4, num_blocks: int = 64) -> tuple[ModelRunner, Scheduler]:
    arch = architecture_config(load_hf_config(path))
    runner = ModelRunner(arch, iterate_safetensors(path), dtype="float32", device="cpu", attention_backend="torch",
                         max_model_len=256, block_size=block_size, num_blocks=num_blocks)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=budget), KVCacheManager(BlockPool(num_blocks),
                          block_size), max_model_len=256)
    return runner, scheduler


def run_recording_logits(runner: ModelRunner, scheduler: Scheduler) -> dict[str, dict[int, torch.Tensor]]:
    """Greedy-decode everything, keeping our logits at every position each step computed."""
    logits_at: dict[str, dict[int, torch.Tensor]] = {}
    while scheduler.num_unfinished:
        output = scheduler.schedule()
        batch = runner.build_batch(output.scheduled)
        with torch.inference_mode():
            hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.metadata)
            logits = runner.model.compute_logits(hidden)
        sampled = {}
        for index, scheduled in enumerate(batch.rows):
            start, end = batch.metadata.query_start_list[index], batch.metadata.query_start_list[index + 1]
            first = scheduled.request.num_computed_tokens
            record = logits_at.setdefault(scheduled.request.request_id, {})
            for offset in range(end - start):
                record[first + offset] = logits[start + offset]
            if scheduled.samples:
                sampled[scheduled.request.request_id] = [int(logits[end - 1].argmax())]
        scheduler.update_from_output(output, sampled)
    return logits_at


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers_in_prefill_chunks_and_decode(tmp_path: Path, case: str) -> None:
    import transformers

    path = build_random_llama(tmp_path, **CASES[case])
    oracle = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner, scheduler = make_parts(path, budget=5)
    prompts = {"long": list(range(3, 14)), "short": [17, 5, 9, 200, 31, 8, 8]}
    assert_logits_match(oracle, runner, scheduler, prompts, max_tokens=6)


def assert_logits_match(oracle: torch.nn.Module, runner: ModelRunner, scheduler: Scheduler,
                        prompts: dict[str, list[int]], max_tokens: int) -> None:
    """Greedy-decode `prompts` with our parts; every position's logits equal the oracle's on the same tokens."""
    requests = [Request(name, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), eos_token_ids=())
                for name, prompt in prompts.items()]
    for request in requests:
        scheduler.add_request(request)
    ours = run_recording_logits(runner, scheduler)
    for request in requests:
        tokens = torch.tensor([request.all_token_ids[:-1]])
        with torch.no_grad():
            expected = oracle(tokens).logits[0]
        positions = sorted(ours[request.request_id])
        assert positions == list(range(request.num_tokens - 1))
        got = torch.stack([ours[request.request_id][p] for p in positions])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


# Windows narrower than the prompts below, ending on and off a block of 4.
WINDOWED_CASES = {
    "mistral-window-6-every-layer": dict(architecture="mistral", num_heads=4, num_kv_heads=2, sliding_window=6),
    # The upper half of the layers slides (max_window_layers), the lower attends to everything.
    "qwen2-window-8-upper-layers": dict(architecture="qwen2", num_heads=6, num_kv_heads=2, hidden_size=96,
                                        num_layers=4, sliding_window=8),
    "phi3-window-5": dict(architecture="phi3", num_heads=4, num_kv_heads=2, sliding_window=5),
    # Local and global layers alternating; caps small enough to bite on these scores and logits, a query
    # scalar apart from head_dim, tied embeddings.
    "gemma2-softcaps-alternating": dict(
        architecture="gemma2", num_heads=4, num_kv_heads=2, num_layers=4, sliding_window=6,
        tie_word_embeddings=True,
        extra_config={"attn_logit_softcapping": 3.0, "final_logit_softcapping": 4.0, "query_pre_attn_scalar": 24}),
    # Per-head q/k norms; the local layers' RoPE base apart from the global layers', which scale linearly.
    "gemma3-local-global-rope": dict(
        architecture="gemma3", num_heads=4, num_kv_heads=2, num_layers=4, sliding_window=7, tie_word_embeddings=True,
        extra_config={"layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                      "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                          "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                             "rope_theta": 1e6}}}),
}


@pytest.mark.parametrize("case", WINDOWED_CASES)
def test_sliding_windows_match_transformers_past_the_window(tmp_path: Path, case: str) -> None:
    """Prompts two to four windows long, prefilled in chunks of 5 over a cached prefix (each chunk's
    first tokens see keys of the chunk before), then decodes that slide on: every position's logits
    against transformers' sliding mask."""
    import transformers

    path = build_random_llama(tmp_path, **WINDOWED_CASES[case])
    arch = architecture_config(load_hf_config(path))
    assert any(window is not None for window in arch.layer_windows)
    # Eager attention: transformers' SDPA path has no soft cap.
    oracle = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    runner, scheduler = make_parts(path, budget=5)
    generator = torch.Generator().manual_seed(1)
    prompts = {"long": torch.randint(3, 320, (23,), generator=generator).tolist(),
               "short": torch.randint(3, 320, (12,), generator=generator).tolist()}
    assert_logits_match(oracle, runner, scheduler, prompts, max_tokens=10)


def test_bfloat16_puts_weights_and_cache_in_bfloat16(tmp_path: Path) -> None:
    path = build_random_llama(tmp_path)
    arch = architecture_config(load_hf_config(path))
    runner = ModelRunner(arch, iterate_safetensors(path), dtype="bfloat16", device="cpu", attention_backend="torch",
                         max_model_len=256, block_size=4, num_blocks=16)
    assert runner.kv_caches[0].dtype == torch.bfloat16
    assert runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16


# The fields every Llama-shaped config.json writes: what the sliding window cases leave alone.
SHAPE = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 24,
         "num_attention_heads": 4}
QWEN2 = {"architectures": ["Qwen2ForCausalLM"]}


ALTERNATING = ["sliding_attention", "full_attention"] * 12


@pytest.mark.parametrize(("config", "windows"), [
    ({"architectures": ["LlamaForCausalLM"], "sliding_window": 128}, ()),  # transformers' Llama has none
    ({"architectures": ["MistralForCausalLM"]}, (4096,) * 24),  # MistralConfig's default where the key is absent
    ({"architectures": ["MistralForCausalLM"], "sliding_window": None}, ()),  # Mistral v0.2 and later
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, (4096,) * 24),
    ({**QWEN2, "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 21}, ()),  # Qwen2.5
    ({**QWEN2, "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 21},
     (None,) * 21 + (4096,) * 3),
    ({**QWEN2, "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 24}, ()),
    ({**QWEN2, "sliding_window": 4096, "use_sliding_window": True, "layer_types": ["full_attention"] * 24}, ()),
    ({**QWEN2, "sliding_window": 64, "use_sliding_window": True, "layer_types": ALTERNATING}, (64, None) * 12),
], ids=["llama", "mistral-default", "mistral-null", "mistral-4096", "qwen2-off", "qwen2-upper-layers",
        "qwen2-no-layer-slides", "qwen2-layer-types-full", "qwen2-layer-types-alternating"])
def test_sliding_window_is_read_per_layer_as_transformers_applies_it(config: dict,
                                                                     windows: tuple[int | None, ...]) -> None:
    assert architecture_config({**SHAPE, **config}).layer_windows == windows


@pytest.mark.parametrize(("architecture", "qkv_bias", "o_bias"), [
    ("LlamaForCausalLM", True, True), ("MistralForCausalLM", False, False), ("Qwen2ForCausalLM", True, False)])
def test_each_architecture_reads_its_own_attention_biases(architecture: str, qkv_bias: bool, o_bias: bool) -> None:
    """Llama's `attention_bias` covers q/k/v and the output projection; Qwen2 biases q/k/v whatever the
    file says; Mistral has no bias."""
    arch = architecture_config({**SHAPE, "architectures": [architecture], "attention_bias": True})
    assert (arch.architecture, arch.qkv_bias, arch.o_bias) == (architecture, qkv_bias, o_bias)


@pytest.mark.parametrize(("chunked", "window"), [(True, None), (False, None), (True, 24), (False, 24)],
                         ids=["chunked-prefill", "sdpa-prefill", "chunked-prefill-window-24", "sdpa-prefill-window-24"])
def test_bfloat16_logits_stay_as_close_to_float32_as_transformers_bfloat16(
        tmp_path: Path, chunked: bool, window: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 CPU path (C decode kernel, the prompts' attention in chunked matmuls with bf16 scores
    where the CPU has no AMX, SDPA's flash kernel where it has: both, whatever this CPU) against transformers
    in fp32 on the same weights: its logits must be about as close to fp32's as transformers' own bf16
    run is, and pick fp32's greedy token about as often. Head size 64 (the C kernel's unrolled
    case); a 300-token prompt in one step (past one prefill chunk, no cached prefix) and a 40-token one
    prefilled in chunks of 16 (a cached prefix), then decodes over blocks of 16; and the same as a
    Mistral whose every layer slides a window of 24 tokens (each chunk's keys start inside the window,
    the C kernel skips the blocks before it)."""
    import transformers

    from cluster.model.attention.torch_backend import TorchAttentionBackend

    monkeypatch.setattr(TorchAttentionBackend, "use_chunked_prefill", chunked)
    path = build_random_llama(tmp_path, num_heads=6, num_kv_heads=2, hidden_size=384, vocab_size=512,
                              max_position_embeddings=512, sliding_window=window,
                              architecture="llama" if window is None else "mistral")
    arch = architecture_config(load_hf_config(path))
    runner = ModelRunner(arch, iterate_safetensors(path), dtype="bfloat16", device="cpu", attention_backend="torch",
                         max_model_len=512, block_size=16, num_blocks=64)
    generator = torch.Generator().manual_seed(0)
    prompts = {"long": torch.randint(3, 512, (300,), generator=generator).tolist(),
               "chunked": torch.randint(3, 512, (40,), generator=generator).tolist()}
    ours: dict[str, dict[int, torch.Tensor]] = {}
    requests = []
    for name, prompt in prompts.items():  # one at a time: the budget decides how each prompt is cut
        request = Request(name, prompt, SamplingParams(max_tokens=20, temperature=0), eos_token_ids=())
        scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=512 if name == "long" else 16),
                              KVCacheManager(BlockPool(64), 16), max_model_len=512)
        scheduler.add_request(request)
        ours |= run_recording_logits(runner, scheduler)
        requests.append(request)
    oracles = {dtype: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
               for dtype in (torch.float32, torch.bfloat16)}
    for request in requests:
        tokens = torch.tensor([request.all_token_ids[:-1]])
        with torch.no_grad():
            exact, theirs = (oracles[dtype](tokens).logits[0].float() for dtype in (torch.float32, torch.bfloat16))
        got = torch.stack([ours[request.request_id][p] for p in range(request.num_tokens - 1)]).float()
        our_error, their_error = (got - exact).abs().mean(), (theirs - exact).abs().mean()
        assert our_error <= 1.5 * their_error, (request.request_id, float(our_error), float(their_error))
        # Random weights leave near ties that bf16 rounding flips: no better than transformers' own bf16. The
        # windowed model's 40-token request has more of them (the flipped positions' top-two margins 0.03-0.4,
        # against a per-position error of 0.05-0.3, as large as transformers' bf16's): 3 of its 59 more.
        slack = 0.05 if window is None else 0.1
        agreement, their_agreement = ((x.argmax(-1) == exact.argmax(-1)).float().mean() for x in (got, theirs))
        assert agreement >= their_agreement - slack, (request.request_id, float(agreement), float(their_agreement))


def fp8_kv_attention(fp8: torch.dtype):  # type: ignore[no-untyped-def]
    """Transformers' SDPA attention with its keys and values rounded through `fp8` first, as a cache of
    that dtype holds them (saturated at its largest value): the oracle of an fp8 KV cache."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from pdserve_kernels.reference import to_cache_dtype

    def attention(module, query, key, value, *args, **kwargs):  # type: ignore[no-untyped-def]
        key, value = (to_cache_dtype(x, fp8).to(x.dtype) for x in (key, value))
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)
    return attention


@pytest.mark.parametrize("kv_cache_dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("model_dtype", ["float32", "bfloat16"])
def test_an_fp8_cache_gives_the_logits_of_keys_and_values_rounded_to_fp8(
        tmp_path: Path, kv_cache_dtype: str, model_dtype: str) -> None:
    """`kv_cache_dtype` fp8 (`CacheConfig`): the cache holds a byte per key and value, the C decode kernel
    and the prompts' attention read it widened. Against transformers in fp32 whose attention rounds its
    keys and values through the same fp8 (the only error fp8 may add): in fp32 as close as the fp32
    cache is to plain transformers (fp8's own effect 1e4 times larger); in bf16 within fp8's effect plus bf16's.
    A prompt in one step (no cached prefix) and one in chunks of 16, then decodes over blocks of 16."""
    import transformers
    from transformers import AttentionInterface

    fp8 = getattr(torch, kv_cache_dtype)
    name = f"pdserve_{kv_cache_dtype}"
    AttentionInterface.register(name, fp8_kv_attention(fp8))
    path = build_random_llama(tmp_path, num_heads=6, num_kv_heads=2, hidden_size=384, vocab_size=512,
                              max_position_embeddings=512)
    arch = architecture_config(load_hf_config(path))
    runner = ModelRunner(arch, iterate_safetensors(path), dtype=model_dtype, device="cpu", attention_backend="torch",
                         max_model_len=512, block_size=16, num_blocks=64, kv_cache_dtype=kv_cache_dtype)
    assert runner.kv_caches[0].dtype == fp8
    generator = torch.Generator().manual_seed(0)
    prompts = {"whole": torch.randint(3, 512, (150,), generator=generator).tolist(),
               "chunked": torch.randint(3, 512, (40,), generator=generator).tolist()}
    ours: dict[str, dict[int, torch.Tensor]] = {}
    requests = []
    for key, prompt in prompts.items():
        request = Request(key, prompt, SamplingParams(max_tokens=12, temperature=0), eos_token_ids=())
        scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=512 if key == "whole" else 16),
                              KVCacheManager(BlockPool(64), 16), max_model_len=512)
        scheduler.add_request(request)
        ours |= run_recording_logits(runner, scheduler)
        requests.append(request)
    rounded = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                attn_implementation=name).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, model_dtype)).eval()
    exact_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for request in requests:
        tokens = torch.tensor([request.all_token_ids[:-1]])
        with torch.no_grad():
            exact, their_bf16 = rounded(tokens).logits[0], theirs(tokens).logits[0].float()
        got = torch.stack([ours[request.request_id][p] for p in range(request.num_tokens - 1)]).float()
        with torch.no_grad():
            plain = exact_model(tokens).logits[0]
        error, fp8_effect = (got - exact).abs().mean(), (plain - exact).abs().mean()
        if model_dtype == "float32":  # 1-6e-5 against fp8's 0.6-1.1; a rare position off where a key sat on a
            # rounding boundary (the rotary's last bit, which the CPU's instructions decide, picks its side)
            row_error = (got - exact).abs().amax(dim=-1)
            assert error <= 1e-3 * fp8_effect and int((row_error > 0.05).sum()) <= 1 and \
                row_error.max() <= fp8_effect, (float(error), float(fp8_effect), row_error.tolist())
        else:  # bf16 keys land on other sides of fp8's boundaries: fp8's rounding drawn anew, not added
            bf16_effect = (their_bf16 - plain).abs().mean()
            assert error <= fp8_effect + 2 * bf16_effect, (float(error), float(fp8_effect), float(bf16_effect))
