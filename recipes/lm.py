"""Character language models of the ddp-bench table (docs/design/ddp-bench.md): char-rnn and
gpt-nano.

Both map int64 indices ``[B, T]`` to next-character logits ``[B, T, V]``. ``vocab`` is the
vocabulary string (``dataset.vocab``: index ``i`` is character ``vocab[i]``), or only its size.
Given as a string it is kept as the int64 buffer ``vocab_codes`` (its code points): it travels
with the weights into ``model.pt`` and checkpoints, and :attr:`vocab` reads it back. Integer
buffers are not averaged (identical on every rank anyway). Plain ``nn.Module``s.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CharRNN", "GPTNano"]


class _Vocab(nn.Module):
    """Holds the vocabulary (size, and the characters when given) for the LM models."""

    vocab_codes: torch.Tensor

    def _init_vocab(self, vocab: str | int, *, model: str) -> int:
        if isinstance(vocab, str):
            if not vocab or len(set(vocab)) != len(vocab):
                raise ValueError(f"{model}: vocab={vocab!r}: must be distinct characters")
            self.register_buffer(
                "vocab_codes", torch.tensor([ord(c) for c in vocab], dtype=torch.int64)
            )
            return len(vocab)
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise ValueError(
                f"{model}: vocab={vocab!r}: give the vocabulary string (dataset.vocab) or its size"
            )
        return vocab

    @property
    def vocab(self) -> str | None:
        """The vocabulary string the model was built with (None when built from a size)."""
        codes = getattr(self, "vocab_codes", None)
        return None if codes is None else "".join(chr(int(c)) for c in codes)


class CharRNN(_Vocab):
    """Embedding(V, 128) -> LSTM 256 x 2 layers (dropout 0.2 between them) -> Linear(256, V)."""

    def __init__(
        self,
        vocab: str | int,
        embed: int = 128,
        hidden: int = 256,
        layers: int = 2,
        dropout: float = 0.2,
    ) -> None:
        super().__init__()
        size = self._init_vocab(vocab, model="CharRNN")
        if min(int(embed), int(hidden), int(layers)) < 1 or not 0.0 <= float(dropout) < 1.0:
            raise ValueError(
                f"CharRNN: embed={embed}, hidden={hidden}, layers={layers}: must be >= 1; "
                f"dropout={dropout}: must be in [0, 1)"
            )
        self.embed = nn.Embedding(size, int(embed))
        self.lstm = nn.LSTM(
            int(embed),
            int(hidden),
            num_layers=int(layers),
            dropout=float(dropout) if int(layers) > 1 else 0.0,
            batch_first=True,
        )
        self.head = nn.Linear(int(hidden), size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(idx))  # each window starts from a zero state
        return self.head(out)


class _Block(nn.Module):
    """Pre-norm transformer block: x + attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, d_model: int, heads: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model), nn.Dropout(dropout)
        )

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attend(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTNano(_Vocab):
    """A nanoGPT-style decoder: 4 pre-norm layers, 4 heads, d_model 128, d_ff 512, causal
    attention (``scaled_dot_product_attention(is_causal=True)``), learned positions up to
    ``block_size``, a final LayerNorm and a head **tied** to the token embedding (as nanoGPT;
    ``tie_head=False`` unties it). Init: normal(0, 0.02), residual projections scaled by
    1/sqrt(2 x layers), as GPT-2."""

    def __init__(
        self,
        vocab: str | int,
        block_size: int = 64,
        layers: int = 4,
        heads: int = 4,
        d_model: int = 128,
        d_ff: int = 512,
        dropout: float = 0.0,
        tie_head: bool = True,
    ) -> None:
        super().__init__()
        size = self._init_vocab(vocab, model="GPTNano")
        if min(int(block_size), int(layers), int(heads), int(d_ff)) < 1:
            raise ValueError(
                f"GPTNano: block_size={block_size}, layers={layers}, heads={heads}, "
                f"d_ff={d_ff}: must all be >= 1"
            )
        if int(d_model) < 1 or int(d_model) % int(heads):
            raise ValueError(f"GPTNano: d_model={d_model}: must be a multiple of heads={heads}")
        self.block_size = int(block_size)
        self.tok = nn.Embedding(size, int(d_model))
        self.pos = nn.Embedding(self.block_size, int(d_model))
        self.drop = nn.Dropout(float(dropout))
        self.blocks = nn.ModuleList(
            _Block(int(d_model), int(heads), int(d_ff), float(dropout)) for _ in range(int(layers))
        )
        self.ln_f = nn.LayerNorm(int(d_model))
        self.head = nn.Linear(int(d_model), size, bias=False)
        self._init_weights(int(layers))
        if tie_head:
            self.head.weight = self.tok.weight

    def _init_weights(self, layers: int) -> None:
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # biases and LayerNorm gains keep their defaults (0 / 1)
            std = (
                0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "2.weight")) else 0.02
            )
            nn.init.normal_(p, 0.0, std)
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(
                f"GPTNano: input of {t} positions exceeds block_size={self.block_size}"
            )
        positions = torch.arange(t, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
