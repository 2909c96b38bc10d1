"""Megatron's formats: `.bin`/`.idx` token files, GPT samples, blends and splits, their
indices (built once, cached), and preprocessing (JSONL to token files)."""
