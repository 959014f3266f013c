"""The sparse mixture-of-experts block against a per-token reference, and the loading of expert weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn import functional

from cluster.model import moe
from cluster.model.architecture import MoeConfig
from cluster.model.moe import Experts, SparseMoeBlock, grouped_mm_serves
from cluster.model.registry import architecture_config
from cluster.model.runner import ModelRunner
from cluster.weights.loader import iterate_safetensors, load_hf_config
from cluster.weights.synthetic import build_random_llama

HIDDEN = 32


def test_widths_off_16_bytes_take_the_loop() -> None:
    """The grouped matmul needs row strides of multiples of 16 bytes: 20 bf16 values are 40."""
    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.bfloat16)

    assert grouped_mm_serves(zeros(2, 32), zeros(4, 48, 32), zeros(4, 32, 24))
    assert not grouped_mm_serves(zeros(2, 32), zeros(4, 40, 32), zeros(4, 32, 20))


def random_block(num_experts: int, top_k: int, renormalize: bool, seed: int = 0) -> SparseMoeBlock:
    moe = MoeConfig(num_experts=num_experts, num_experts_per_tok=top_k, intermediate_size=24,
                    renormalize=renormalize, sparse_layers=(0,))
    block = SparseMoeBlock(HIDDEN, moe)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return block


@torch.no_grad()
def per_token_reference(block: SparseMoeBlock, x: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """Each token on its own: softmax over the router's logits, its top-k experts (renormalized or
    not), the weighted sum of their SwiGLU outputs. In fp32 whatever x's dtype."""
    gate_up, down = block.experts.gate_up_proj.float(), block.experts.down_proj.float()
    out = torch.zeros(x.shape, dtype=torch.float32)
    for token, row in enumerate(x.float()):
        probabilities = torch.softmax(block.gate.weight.float() @ row, dim=-1)
        weights, chosen = probabilities.topk(top_k)
        if renormalize:
            weights = weights / weights.sum()
        for weight, expert in zip(weights, chosen, strict=True):
            gate, up = (gate_up[expert] @ row).chunk(2)
            out[token] += weight * (down[expert] @ (functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize(("num_experts", "top_k"), [(4, 2), (8, 2), (8, 1), (6, 3)])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "softmax-weights"])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped-mm", "per-expert-loop"])
def test_the_sorted_experts_give_each_token_its_top_k_experts_weighted(  # noqa: PLR0913
        tokens: int, num_experts: int, top_k: int, renormalize: bool, grouped: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moe, "use_grouped_mm", grouped)
    block = random_block(num_experts, top_k, renormalize)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    assert grouped_mm_serves(x, block.experts.gate_up_proj, block.experts.down_proj) == grouped
    with torch.no_grad():
        got = block(x)
    torch.testing.assert_close(got, per_token_reference(block, x, top_k, renormalize), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped-mm", "per-expert-loop"])
def test_bfloat16_experts_stay_within_bfloat16_rounding_of_the_reference(
        grouped: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moe, "use_grouped_mm", grouped)
    block = random_block(8, 2, renormalize=True).to(torch.bfloat16)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        got = block(x)
    assert got.dtype == torch.bfloat16
    expected = per_token_reference(block, x, 2, renormalize=True)
    torch.testing.assert_close(got.float(), expected, atol=0.05 * float(expected.abs().max()), rtol=0.05)


def test_the_loop_computes_only_the_experts_its_tokens_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    """One matmul pair per expert chosen, over that expert's rows only: no work for the others."""
    monkeypatch.setattr(moe, "use_grouped_mm", False)
    block = random_block(8, 1, renormalize=False)
    shapes: list[tuple[int, ...]] = []
    real_linear = functional.linear

    def counting_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shapes.append(tuple(x.shape))
        return real_linear(x, weight, bias)

    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        chosen = block.gate(x).argmax(-1)
        monkeypatch.setattr(functional, "linear", counting_linear)
        block(x)
    expert_rows = sorted(shapes[1:])  # the router's own linear first
    assert len(expert_rows) == 2 * len(set(chosen.tolist()))
    assert sum(rows for rows, _ in expert_rows) == 2 * 3


# ---- loading ------------------------------------------------------------------------------------------

def tiny_qwen3_moe(path: Path) -> Path:
    return build_random_llama(path, architecture="qwen3_moe", num_layers=2,
                              moe={"num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [0]})


def runner_for(path: Path, weights: list[tuple[str, torch.Tensor]], deterministic: bool = False) -> ModelRunner:
    arch = architecture_config(load_hf_config(path))
    return ModelRunner(arch, weights, dtype="float32", device="cpu", attention_backend="torch", max_model_len=64,
                       block_size=4, num_blocks=16, deterministic=deterministic)


def experts_of(runner: ModelRunner, layer: int) -> Experts:
    block = runner.model.model.layers[layer].mlp
    assert isinstance(block, SparseMoeBlock)
    return block.experts


def test_expert_tensors_load_into_slices_of_the_stacked_parameters(tmp_path: Path) -> None:
    path = tiny_qwen3_moe(tmp_path)
    weights = dict(iterate_safetensors(path))
    experts = experts_of(runner_for(path, list(weights.items())), 1)
    inter = weights["model.layers.1.mlp.experts.2.gate_proj.weight"].shape[0]
    assert torch.equal(experts.gate_up_proj[2, :inter], weights["model.layers.1.mlp.experts.2.gate_proj.weight"])
    assert torch.equal(experts.gate_up_proj[2, inter:], weights["model.layers.1.mlp.experts.2.up_proj.weight"])
    assert torch.equal(experts.down_proj[3], weights["model.layers.1.mlp.experts.3.down_proj.weight"])


def test_a_missing_expert_tensor_is_named(tmp_path: Path) -> None:
    path = tiny_qwen3_moe(tmp_path)
    weights = [(name, tensor) for name, tensor in iterate_safetensors(path)
               if name != "model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        runner_for(path, weights)


@pytest.mark.parametrize("name", ["model.layers.1.mlp.experts.4.up_proj.weight",  # 4 experts: 0-3
                                  "model.layers.1.mlp.experts.0.w4.weight",
                                  "model.layers.0.mlp.experts.0.up_proj.weight"])  # layer 0 is dense
def test_an_expert_tensor_of_no_parameter_is_refused(tmp_path: Path, name: str) -> None:
    path = tiny_qwen3_moe(tmp_path)
    weights = [*iterate_safetensors(path), (name, torch.zeros(1))]
    with pytest.raises(ValueError, match=f"{name.replace('.', '[.]')}.*matches no parameter"):
        runner_for(path, weights)


def test_stacked_expert_tensors_load_whole(tmp_path: Path) -> None:
    """A checkpoint that stores each layer's experts stacked (transformers' in-memory layout) loads too."""
    path = tiny_qwen3_moe(tmp_path)
    weights = dict(iterate_safetensors(path))
    stacked = {name: tensor for name, tensor in weights.items() if ".experts." not in name}
    for projection, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        stacked[f"model.layers.1.mlp.experts.{projection}"] = torch.stack([
            torch.cat([weights[f"model.layers.1.mlp.experts.{expert}.{part}.weight"] for part in parts])
            for expert in range(4)])
    experts = experts_of(runner_for(path, list(stacked.items())), 1)
    assert torch.equal(experts.down_proj, stacked["model.layers.1.mlp.experts.down_proj"])


def test_deterministic_mode_refuses_a_mixture_of_experts(tmp_path: Path) -> None:
    """Each expert's matmul has as many rows as tokens chose it, so its sums depend on the batch."""
    path = tiny_qwen3_moe(tmp_path)
    with pytest.raises(ValueError, match="deterministic mode does not cover mixture-of-experts"):
        runner_for(path, list(iterate_safetensors(path)), deterministic=True)


@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral"])
def test_an_engine_serves_a_mixture_of_experts_greedily_as_transformers_generates(
        tmp_path: Path, architecture: str) -> None:
    """Two prompts batched through `LLMEngine` (its scheduler, cache and sampler) against transformers'
    greedy `generate`, each alone."""
    import transformers

    from cluster.common.sampling_params import SamplingParams
    from cluster.engine.config import CacheConfig, EngineConfig
    from cluster.engine.llm_engine import LLMEngine
    from cluster.weights.synthetic import build_tiny_llama_checkpoint
    from tests.helpers import fp32_model

    checkpoint = build_tiny_llama_checkpoint(tmp_path / "tiny", architecture=architecture)
    engine = LLMEngine(EngineConfig(model=fp32_model(checkpoint), cache=CacheConfig(block_size=4, num_blocks=64)))
    prompts = [[5, 17, 9, 200, 31], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    oracle = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = oracle.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(prompt):].tolist()
        assert output.token_ids == expected
