"""The transformer that `streamload calibrate` times (and `benchmarks/train_step.py` trains):
blocks of real SDPA attention with document masking over packed rows, one causal call per run
of equal-length documents (`doc_attention`; see `calibrate`'s docstring for why). Imports torch
lazily, so the commands' parser stays light."""
from __future__ import annotations

import functools

import numpy as np

from ..plan.cost import CostModel


def _torch():
    import torch
    return torch


def document_mask(lengths, device=None):
    """Boolean [T, T] block-diagonal causal mask (True = may attend), from document lengths.

    Reference only: `doc_attention` gives the same result without the T×T work.
    """
    torch = _torch()
    lengths = torch.as_tensor(list(lengths), dtype=torch.long, device=device)
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    pos = torch.arange(doc.numel(), device=device)
    return (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])


def _runs(lengths: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive equal lengths: (start token, length, count)."""
    runs, start = [], 0
    for L in lengths:
        if runs and runs[-1][1] == L:
            s0, _, n = runs[-1]
            runs[-1] = (s0, L, n + 1)
        else:
            runs.append((start, L, 1))
        start += L
    return runs


def doc_attention(q, k, v, lengths, causal: bool = True, max_calls: int = 32):
    """Attention within each document of a packed row. q, k, v: [T, H, hd]; returns [T, H, hd].

    The work is Σ L², not T². Consecutive documents of equal length are one batched SDPA call
    on a view of the row (no copy); a row with more than `max_calls` such runs instead stacks
    all documents of equal length with one gather, so the number of calls is the number of
    distinct lengths.

    The row is cut with one `split` (or one `index_select` of the whole row), never with one
    slice per call: the backward of a slice writes its gradient into a zeroed tensor of the
    whole row, so k slices cost O(k·T) per tensor and layer, which made a row of many short
    documents cost more than its Σ L² + Σ L (issue 20: 32 documents of distinct lengths in a
    2048-token row took 1.5x the time of 32 equal ones). `split` and one gather have O(T)
    backwards.
    """
    torch = _torch()
    F = torch.nn.functional
    lengths = [int(x) for x in lengths]
    T, H, hd = q.shape
    if sum(lengths) != T:
        raise ValueError(f"doc_attention: document lengths sum to {sum(lengths)}, row has {T} tokens")

    def attend(qs, ks, vs, n, L):
        qs, ks, vs = (x.reshape(n, L, H, hd).transpose(1, 2) for x in (qs, ks, vs))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
        return out.transpose(1, 2).reshape(n * L, H, hd)

    runs = _runs(lengths)
    if len(runs) == 1:
        return attend(q, k, v, runs[0][2], runs[0][1])
    if len(runs) <= max_calls:
        sizes = [n * L for _, L, n in runs]
        parts = zip(q.split(sizes, 0), k.split(sizes, 0), v.split(sizes, 0), runs)
        return torch.cat([attend(qs, ks, vs, n, L) for qs, ks, vs, (_, L, n) in parts], 0)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    arr = np.asarray(lengths)
    perm, groups = [], []
    for L in sorted(set(lengths), reverse=True):
        group = starts[arr == L]
        perm.append((group[:, None] + np.arange(L)[None, :]).reshape(-1))
        groups.append((group.shape[0], L))
    perm = np.concatenate(perm)
    it = torch.as_tensor(perm, device=q.device)
    sizes = [n * L for n, L in groups]
    parts = zip(*(x.index_select(0, it).split(sizes, 0) for x in (q, k, v)), groups)
    out = torch.cat([attend(qs, ks, vs, n, L) for qs, ks, vs, (n, L) in parts], 0)
    inverse = np.empty(T, dtype=np.int64)
    inverse[perm] = np.arange(T)
    return out.index_select(0, torch.as_tensor(inverse, device=q.device))


@functools.lru_cache(maxsize=None)
def _build_modules():
    torch = _torch()
    nn = torch.nn

    class Block(nn.Module):
        """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)). Input [T, d]."""

        def __init__(self, d_model: int, heads: int, ffn_mult: int = 4):
            super().__init__()
            if d_model % heads:
                raise ValueError(f"d_model ({d_model}) must be a multiple of heads ({heads})")
            self.heads = heads
            self.ln1 = nn.LayerNorm(d_model)
            self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
            self.proj = nn.Linear(d_model, d_model, bias=False)
            self.ln2 = nn.LayerNorm(d_model)
            self.up = nn.Linear(d_model, ffn_mult * d_model, bias=False)
            self.down = nn.Linear(ffn_mult * d_model, d_model, bias=False)

        def forward(self, x, lengths):
            T, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(T, 3, self.heads, d // self.heads).unbind(1)
            x = x + self.proj(doc_attention(q, k, v, lengths).reshape(T, d))
            return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))

    class TinyTransformer(nn.Module):
        """Embedding, n blocks, final norm and output head; loss is next-token cross-entropy."""

        def __init__(self, vocab: int, d_model: int, heads: int, ffn_mult: int, n_layers: int):
            super().__init__()
            self.embed = nn.Embedding(vocab, d_model)
            self.blocks = nn.ModuleList(Block(d_model, heads, ffn_mult) for _ in range(n_layers))
            self.ln = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab, bias=False)
            self.d_model, self.n_layers = d_model, n_layers

        def compute_params(self) -> int:
            """Parameters every token multiplies through (all but the embedding lookup)."""
            return sum(p.numel() for n, p in self.named_parameters() if not n.startswith("embed."))

        def cost_model(self, document_masking: bool = True) -> CostModel:
            return CostModel.transformer(self.compute_params(), self.n_layers, self.d_model,
                                         causal=True, document_masking=document_masking)

        @property
        def device(self):
            return str(self.head.weight.device)

        def make_input(self, row, generator):
            tokens = torch.randint(0, self.head.out_features, (sum(row),), generator=generator)
            return tokens.to(self.head.weight.device)

        def step(self, tokens, lengths):
            """One forward plus backward of a packed row; gradients accumulate."""
            self(tokens, lengths).backward()

        def forward(self, tokens, lengths):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x, lengths)
            logits = self.head(self.ln(x))
            return torch.nn.functional.cross_entropy(logits[:-1].float(), tokens[1:])

    return Block, TinyTransformer


def Block(d_model: int, heads: int, ffn_mult: int = 4):
    return _build_modules()[0](d_model, heads, ffn_mult)


def TinyTransformer(vocab: int, d_model: int, heads: int, ffn_mult: int = 4, n_layers: int = 2):
    return _build_modules()[1](vocab, d_model, heads, ffn_mult, n_layers)


class Blocks:
    """`n_layers` blocks applied to a [T, d] input; what calibrate times.

    Anything with `make_input(row, generator)` and `step(x, lengths)` (one forward plus
    backward of a packed row) can be timed by `time_rows`; the train_step benchmark times its
    whole model that way.
    """

    def __init__(self, d_model, heads, ffn_mult, n_layers, device, dtype):
        torch = _torch()
        self.layers = torch.nn.ModuleList(Block(d_model, heads, ffn_mult) for _ in range(n_layers))
        self.layers.to(device=device, dtype=dtype)
        self.d_model, self.device, self.dtype = d_model, device, dtype

    def params(self) -> int:
        return sum(p.numel() for p in self.layers.parameters())

    def make_input(self, row, generator):
        torch = _torch()
        return torch.randn(sum(row), self.d_model, generator=generator).to(self.device, self.dtype)

    def step(self, x, lengths):
        for p in self.layers.parameters():
            p.grad = None
        y = x
        for layer in self.layers:
            y = layer(y, lengths)
        y.float().square().mean().backward()
