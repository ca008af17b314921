"""A multi-source corpus with the long tails of published production mixes, as document lengths.

Five sources with different shapes and weights (lengths in tokens, 10 to 1M):

  web      0.40  lognormal, median 700, sigma 1.1, <= 60k            (short, many)
  code     0.15  lognormal, median 1.5k, sigma 1.4, <= 200k
  math     0.10  lognormal, median 400, sigma 0.8, <= 16k
  books    0.15  lognormal, median 60k, sigma 0.9, 2k..800k           (long; outlives the others)
  longmix  0.20  ByteScale's production shape: 80% of documents <= 4k (lognormal, median 800),
                 18.8% log-uniform 4k..128k, 1.2% log-uniform 128k..1M: about 40% of its
                 tokens sit in the 1% >= 128k (ByteScale: 44%)

Token amounts follow the weights, with `books` holding 1.5x its share, so it outlives the
others. Deterministic from the seed. Pure NumPy: the dry run uses the lengths, the loader run
writes them as token shards (`write_token_shards`).
"""
from __future__ import annotations

import numpy as np

WEIGHTS = {"web": 0.40, "code": 0.15, "math": 0.10, "books": 0.15, "longmix": 0.20}
OUTLIVES = {"books": 1.5}


def _lognormal(rng, n, median, sigma, lo, hi):
    return np.clip(rng.lognormal(np.log(median), sigma, n), lo, hi).astype(np.int64)


def _loguniform(rng, n, lo, hi):
    return np.exp(rng.uniform(np.log(lo), np.log(hi), n)).astype(np.int64)


def _draw(name: str, rng, n: int) -> np.ndarray:
    if name == "web":
        return _lognormal(rng, n, 700, 1.1, 10, 60_000)
    if name == "code":
        return _lognormal(rng, n, 1500, 1.4, 10, 200_000)
    if name == "math":
        return _lognormal(rng, n, 400, 0.8, 10, 16_000)
    if name == "books":
        return _lognormal(rng, n, 60_000, 0.9, 2_000, 800_000)
    kind = rng.random(n)
    out = _lognormal(rng, n, 800, 1.0, 10, 4096)
    mid = (kind >= 0.80) & (kind < 0.988)
    out[mid] = _loguniform(rng, int(mid.sum()), 4096, 131_072)
    top = kind >= 0.988
    out[top] = _loguniform(rng, int(top.sum()), 131_072, 1_000_000)
    return out


def corpus(total_tokens: float, seed: int = 0) -> dict[str, np.ndarray]:
    """Document lengths per source, about `total_tokens` in all (before `books`' extra half)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, weight in WEIGHTS.items():
        want = total_tokens * weight * OUTLIVES.get(name, 1.0)
        docs, have = [], 0
        while have < want:
            batch = _draw(name, rng, 4096)
            docs.append(batch)
            have += int(batch.sum())
        lengths = np.concatenate(docs)
        out[name] = lengths[:int(np.searchsorted(np.cumsum(lengths), want)) + 1]
    return out


def tail_stats(lengths: np.ndarray) -> dict:
    """The shape figures the published mixes quote."""
    tokens = float(lengths.sum())
    return {"documents": int(lengths.size), "tokens": int(tokens),
            "docs_le_4k": round(float((lengths <= 4096).mean()), 3),
            "tokens_in_ge_128k": round(float(lengths[lengths >= 131_072].sum()) / tokens, 3),
            "docs_ge_128k": round(float((lengths >= 131_072).mean()), 4)}
