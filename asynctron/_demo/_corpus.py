"""The demo's corpus: deterministic synthetic text, tokenized through asynctron's preprocess
path (byte tokenizer, end-of-document appended) into Megatron's `.bin`/`.idx`."""

from __future__ import annotations

import json
import os
import random

from asynctron.datasets import PreprocessConfig, preprocess

_WORDS = (
    "the", "a", "an", "of", "to", "in", "on", "at", "for", "with", "from", "by", "as", "is",
    "was", "are", "were", "be", "been", "being", "have", "has", "had", "do", "does", "did",
    "will", "would", "can", "could", "shall", "should", "may", "might", "must", "model", "data",
    "train", "step", "loss", "token", "batch", "layer", "weight", "gradient", "tensor", "shard",
    "rank", "loop", "save", "load", "checkpoint", "disk", "page", "cache", "file", "bytes",
    "async", "await", "engine", "write", "read", "stage", "commit", "budget", "prefetch",
    "blend", "sample", "index", "epoch", "seed", "shuffle", "sequence", "length", "attention",
    "head", "hidden", "embedding", "output", "input", "learning", "rate", "optimizer", "adam",
    "momentum", "decay", "warmup", "schedule", "cosine", "linear", "norm", "river", "mountain",
    "forest", "ocean", "city", "village", "garden", "window", "door", "table", "chair", "book",
    "letter", "morning", "evening", "night", "summer", "winter", "spring", "autumn", "red",
    "blue", "green", "golden", "quiet", "bright",
)


def write_corpus(directory: str, *, num_documents: int, seed: int) -> str:
    """Write `num_documents` documents of a few sentences each as JSON lines under
    `directory`, preprocess them, and return the dataset prefix (`<prefix>.bin/.idx`)."""
    os.makedirs(directory, exist_ok=True)
    rng = random.Random(seed)
    jsonl = os.path.join(directory, "corpus.jsonl")
    with open(jsonl, "w") as f:
        for _ in range(num_documents):
            sentences = []
            for _ in range(rng.randint(2, 12)):
                words = rng.choices(_WORDS, k=rng.randint(4, 16))
                sentences.append(" ".join(words).capitalize() + ".")
            f.write(json.dumps({"text": " ".join(sentences)}) + "\n")
    result = preprocess(PreprocessConfig(input=jsonl,
                                         output_prefix=os.path.join(directory, "corpus"),
                                         tokenizer="byte", append_eod=True))
    return result.output_prefixes["text"]
