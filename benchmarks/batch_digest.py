"""A digest of everything a job delivers, to show two trees give the same batches and states.

    python benchmarks/batch_digest.py                        # this tree
    PYTHONPATH=/path/to/other/tree python benchmarks/batch_digest.py

For each planner (naive, balanced, lookahead), one epoch through the public Loader at R = 1 and
on 2 gloo ranks, over a skewed corpus (5 JSONL shards, a one-shard token source with fewer
shards than ranks, and an endless long-document source): a hash of every rank's sample ids and
tokens, step by step ("rows": of the rest of each row, position ids, labels, loss mask,
cu_seqlens, max_seqlen, padding), and of the `state_dict()` after 25 steps. Then the dry run
(`simulate`) at R = 8 over scanned lengths: a hash of every step report. A refactoring that
changes no behaviour prints the same JSON line (the digests, not the timings, are compared).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import multiprocessing as mp
import socket
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from corpus import write_jsonl_source, write_token_source  # noqa: E402

PLANNERS = ("naive", "balanced", "lookahead")
STATE_AT = 25


def make_corpus(root: Path) -> None:
    write_jsonl_source(root, "web", shards=5, per_shard=120, median=300, seed=1)
    write_token_source(root, "code", shards=1, per_shard=200, median=900, seed=2)
    write_jsonl_source(root, "long", shards=2, per_shard=30, median=3000, seed=3)


def epoch_digest(root: Path, planner: str) -> dict:
    import streamload as sl
    sources = [sl.Source(str(root / "web"), weight=0.5), sl.Source(str(root / "code"), weight=0.3),
               sl.Source(str(root / "long"), weight=0.2, on_exhausted="restart")]
    batches, rows, state, steps = hashlib.sha256(), hashlib.sha256(), "", 0
    with sl.Loader(sources, micro_batch_tokens=2048, micro_batches=2, epochs=1, seed=7,
                   planner=planner) as loader:
        for batch in loader:
            steps += 1
            for mb in batch.micro_batches:
                batches.update(json.dumps(mb.sample_ids).encode())
                batches.update(mb.tokens.numpy().tobytes())
                for field in (mb.position_ids, mb.labels, mb.loss_mask, mb.cu_seqlens):
                    rows.update(field.numpy().tobytes())
                rows.update(f"{mb.max_seqlen},{mb.padding};".encode())
            if steps == STATE_AT:
                state = hashlib.sha256(loader.state_dict()["streamload"].encode()).hexdigest()[:16]
    return {"steps": steps, "batches": batches.hexdigest()[:16], "state": state,
            "rows": rows.hexdigest()[:16]}


def rank_main(rank: int, world: int, port: int, root: str, planner: str, queue) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    queue.put((rank, epoch_digest(Path(root), planner)))
    dist.destroy_process_group()


def two_ranks(root: Path, planner: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, str(root), planner, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    return [r for _, r in results]


def dryrun_digest(root: Path, planner: str) -> str:
    try:
        from streamload.commands.dryrun import scan, simulate
    except ImportError:   # trees before the commands had their own package
        from streamload.dryrun import scan, simulate
    from streamload.configfile import load_config
    path = root / f"{planner}.toml"
    path.write_text(f'[loader]\nmicro_batch_tokens = 2048\nmicro_batches = 2\nplanner = "{planner}"\n'
                    f'seed = 7\nepochs = 1\n'
                    f'[[source]]\nuri = "{root / "web"}"\nweight = 0.5\n'
                    f'[[source]]\nuri = "{root / "code"}"\nweight = 0.3\n'
                    f'[[source]]\nuri = "{root / "long"}"\nweight = 0.2\non_exhausted = "restart"\n')
    spec = load_config(path)
    names = [s.name for s in spec.sources]
    reports = simulate(spec, scan(spec), steps=400, ranks=8)
    # plan_ms is the planner's CPU time: a timing, not an outcome (it made this digest vary)
    rows = [{k: v for k, v in r.to_dict(names).items() if k != "plan_ms"} for r in reports]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="streamload-digest-"))
    make_corpus(root)
    out = {planner: {"R1": epoch_digest(root, planner), "R2": two_ranks(root, planner),
                     "dryrun_R8": dryrun_digest(root, planner)} for planner in PLANNERS}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
