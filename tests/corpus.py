"""Small deterministic corpora for tests: local files and S3 objects with known sample ids."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from streamload.formats import write_jsonl, write_token_shard

WORDS = "the of and to in is for on that by with data model train token loss step rank".split()


def texts(rng: np.random.Generator, n: int, median: float, sigma: float = 1.0) -> list[str]:
    lengths = np.maximum(1, rng.lognormal(np.log(median), sigma, n).astype(int))
    return [" ".join(rng.choice(WORDS, max(1, L // 4)))[:L] or "x" for L in lengths]


def write_jsonl_source(root: Path, name: str, shards: int, per_shard: int, *, median=200.0,
                       sigma=1.0, compression=None, seed=0) -> set[str]:
    """Writes root/name/part-XXX.jsonl[.gz|.zst]; returns the sample ids (before splitting)."""
    rng = np.random.default_rng(seed)
    suffix = {None: ".jsonl", "gz": ".jsonl.gz", "zst": ".jsonl.zst"}[compression]
    ids = set()
    for i in range(shards):
        path = root / name / f"part-{i:03d}{suffix}"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(path, texts(rng, per_shard, median, sigma), compression=compression)
        ids |= {f"{name}/{path.name}/{r}" for r in range(per_shard)}
    return ids


def write_token_source(root: Path, name: str, shards: int, per_shard: int, *, median=300.0,
                       seed=0) -> set[str]:
    rng = np.random.default_rng(seed)
    ids = set()
    for i in range(shards):
        docs = [rng.integers(0, 50000, max(1, int(L))).astype(np.uint16)
                for L in rng.lognormal(np.log(median), 1.0, per_shard)]
        stem = root / name / f"part-{i:03d}"
        stem.parent.mkdir(parents=True, exist_ok=True)
        write_token_shard(stem, docs)
        ids |= {f"{name}/part-{i:03d}.tokens.npy/{r}" for r in range(per_shard)}
    return ids


def upload_dir(client, bucket: str, local: Path, prefix: str) -> None:
    for path in sorted(local.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(local).as_posix()}")


def base_ids(sample_ids) -> list[str]:
    """Strip the ':k' chunk suffix of split documents."""
    return [s.rsplit(":", 1)[0] if ":" in s.rsplit("/", 1)[-1] else s for s in sample_ids]
