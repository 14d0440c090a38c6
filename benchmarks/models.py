"""The benchmark models, defined here so every implementation trains exactly the same thing (no downloads)."""

import torch
import torch.nn.functional as F
from torch import nn

GPT_VOCAB, GPT_CONTEXT = 8192, 64


class _Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a 4x GELU MLP, each with a residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.ln2, self.fc, self.out = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(att)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A small GPT-2-style language model (about 10M parameters, 76 tensors: embeddings, LayerNorms,
    attention and MLP blocks; the output layer shares the token embedding, as nanoGPT's does). Takes token
    ids (batch, context) and returns the next-token logits flattened to (batch * context, vocab), so that
    cross_entropy(model(x), y.flatten()) is the language-model loss."""

    def __init__(self, vocab: int = GPT_VOCAB, context: int = GPT_CONTEXT, width: int = 320, layers: int = 6,
                 heads: int = 5):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x)).flatten(0, 1)


# name -> (factory, input shape of one sample, per-rank batch)
MODELS = {
    # Compute-bound: ~94K parameters, lots of convolution per byte communicated.
    "cnn": (lambda: nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(64, 10)), (3, 32, 32), 32),
    # Communication-heavy: 6.4M parameters, little compute per parameter.
    "mlp": (lambda: nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)),
        (1024,), 64),
    # Today's typical model: a GPT-style transformer of many small tensors, on token ids.
    "gpt": (GPT, (GPT_CONTEXT,), 4),
}
# A model name may end in -compiled (torch.compile; hvdp's run uses hvdp.torch.compile) and/or -bf16 (the
# forward pass under torch.autocast(bfloat16)): "gpt-compiled-bf16".
VARIANTS = ("compiled", "bf16")


def split_name(name: str) -> tuple[str, bool, bool]:
    """'gpt-compiled-bf16' -> ('gpt', compiled, bf16).

    Raises:
        ValueError: an unknown model or variant.
    """
    base, *variants = name.split("-")
    if base not in MODELS or any(v not in VARIANTS for v in variants):
        raise ValueError(f"unknown model {name!r}: one of {', '.join(MODELS)}, optionally followed by "
                         f"{' and/or '.join('-' + v for v in VARIANTS)}")
    return base, "compiled" in variants, "bf16" in variants


def batch(name: str, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic (inputs, targets) for one step of model `name` (a base name)."""
    _, shape, _ = MODELS[name]
    if name == "gpt":
        tokens = torch.randint(0, GPT_VOCAB, (size, shape[0] + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:].flatten()
    return torch.randn(size, *shape, generator=generator), torch.randint(0, 10, (size,), generator=generator)


def parameters(name: str) -> int:
    return sum(p.numel() for p in MODELS[split_name(name)[0]][0]().parameters())
