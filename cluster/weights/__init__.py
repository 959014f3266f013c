"""Where weights and tokenizers come from: safetensors and GGUF loaders, the default model and its
local cache, the tokenizer with its chat template, and small synthetic checkpoints."""
