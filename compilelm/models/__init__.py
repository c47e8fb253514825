"""Model definitions (plain, like nano-vllm's), their configs, weight loaders and tokenizers."""
