"""The decoder architectures this engine serves, by their Hugging Face `architectures` name (as vLLM's
model registry, but a plain dict).

Each entry pairs the model class to build with the function that reads that architecture's
config.json, quirks included, into an `ArchitectureConfig`. Adding an architecture is a module under
`cluster/model/models/` and its line in `ARCHITECTURES`; an architecture not listed is refused with
the list of the ones that are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster.model.architecture import ArchitectureConfig
from cluster.model.models import gemma, llama, mistral, mixtral, phi3, qwen2, qwen3, qwen3_moe


@dataclass(frozen=True, slots=True)
class ModelEntry:
    # The Llama network or a subclass of it with its own layers (Gemma) or MLPs (the mixtures of experts'
    # `MoeForCausalLM`): the runner's calls (`forward`, `compute_logits`, `load_weights`, `rotary`) and the
    # weight loading are Llama's.
    model_class: type[llama.LlamaForCausalLM]
    read_config: Callable[[dict[str, Any]], ArchitectureConfig]


ARCHITECTURES: dict[str, ModelEntry] = {
    "LlamaForCausalLM": ModelEntry(llama.LlamaForCausalLM, llama.read_config),
    "MistralForCausalLM": ModelEntry(llama.LlamaForCausalLM, mistral.read_config),
    "Qwen2ForCausalLM": ModelEntry(llama.LlamaForCausalLM, qwen2.read_config),
    "Qwen3ForCausalLM": ModelEntry(llama.LlamaForCausalLM, qwen3.read_config),
    "Phi3ForCausalLM": ModelEntry(llama.LlamaForCausalLM, phi3.read_config),
    "Qwen3MoeForCausalLM": ModelEntry(qwen3_moe.MoeForCausalLM, qwen3_moe.read_config),
    "MixtralForCausalLM": ModelEntry(qwen3_moe.MoeForCausalLM, mixtral.read_config),
    "Gemma2ForCausalLM": ModelEntry(gemma.GemmaForCausalLM, gemma.read_gemma2_config),
    "Gemma3ForCausalLM": ModelEntry(gemma.GemmaForCausalLM, gemma.read_gemma3_config),
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(ARCHITECTURES)


def entry_for(architecture: str) -> ModelEntry:
    """The registered entry of a Hugging Face architecture name; a ValueError naming the supported ones."""
    entry = ARCHITECTURES.get(architecture)
    if entry is None:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    return entry


def architecture_config(config: dict[str, Any]) -> ArchitectureConfig:
    """A checkpoint's config.json read by its architecture's reader (the first of `architectures`, or
    `model_type` where that list is missing)."""
    architectures = config.get("architectures") or [config.get("model_type", "unknown")]
    return entry_for(architectures[0]).read_config(config)


def model_class_for(architecture: str) -> type[llama.LlamaForCausalLM]:
    return entry_for(architecture).model_class
