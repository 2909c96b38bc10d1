"""The demo's model: a small GPT (pre-norm decoder blocks, causal attention), deterministic on
CPU, in plain torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _Block(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                 nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(hidden, dim=-1)
        q, k, v = (t.view(batch, length, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, hidden))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, `num_layers` decoder blocks, a tied output layer."""

    def __init__(self, *, vocab_size: int, sequence_length: int, hidden: int, num_layers: int,
                 num_heads: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, hidden)
        self.positions = nn.Embedding(sequence_length, hidden)
        self.blocks = nn.ModuleList(_Block(hidden, num_heads) for _ in range(num_layers))
        self.norm = nn.LayerNorm(hidden)
        for module in self.modules():  # GPT-2's initialization
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.tokens.weight.t()


def language_model_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the next token over the positions the loss mask keeps."""
    logits = model(batch["tokens"].long(), batch["position_ids"].long())
    losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].long().flatten(),
                             reduction="none")
    mask = batch["loss_mask"].flatten().to(losses.dtype)
    return (losses * mask).sum() / mask.sum()
