"""One rank of a small multi-node job, for tests/test_multinode.py (not collected by pytest),
launched by torchrun:

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --rdzv-backend c10d \
        --rdzv-endpoint 127.0.0.1:PORT tests/multinode_worker.py CORPUS OUT [--stop-at K]
    torchrun --nnodes 1 --nproc-per-node 4 ... tests/multinode_worker.py CORPUS OUT --resume STATE

Every rank joins the trainer's process group (gloo here; the loader makes its own gloo group
from it), builds a Loader over CORPUS's three sources for one epoch and iterates it to the end.
With --stop-at K it takes the loader's state after K batches (every rank: they must agree) and
rank 0 writes it to OUT/state.json; the run then goes on to the end of the epoch. With
--resume STATE it starts from that state. Each rank writes OUT/rank-R.json: what the launcher
told it (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, ...), the loader's rank and world size,
the sample ids and micro-batch count of every step, the SHA-256 of its state at --stop-at, and
its control plane's stats (the path: through one leader per node or not; bytes sent and
received).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

LAUNCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
          "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def make_loader(corpus: Path):
    import streamload as sl
    return sl.Loader([sl.Source(str(corpus / "web"), weight=0.5),
                      sl.Source(str(corpus / "code"), weight=0.3),
                      sl.Source(str(corpus / "math"), weight=0.2)],
                     micro_batch_tokens=512, micro_batches=2, epochs=1, seed=7,
                     collective_timeout_s=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("corpus", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--stop-at", type=int, default=None)
    ap.add_argument("--resume", type=Path, default=None)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import datetime

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    record = {"env": {k: os.environ.get(k) for k in LAUNCH}, "steps": [], "state_sha": None}
    try:
        with make_loader(args.corpus) as loader:
            if args.resume is not None:
                loader.load_state_dict(json.loads(args.resume.read_text()))
            record.update(rank=loader.rank, world=loader.world_size)
            for done, batch in enumerate(loader, 1):
                record["steps"].append({"step": batch.step,
                                        "micro_batches": len(batch.micro_batches),
                                        "ids": [i for mb in batch.micro_batches
                                                for i in mb.sample_ids]})
                if done == args.stop_at:
                    state = loader.state_dict()
                    record["state_sha"] = hashlib.sha256(
                        state["streamload"].encode()).hexdigest()
                    if loader.rank == 0:
                        (args.out / "state.json").write_text(json.dumps(state))
            record["control_plane"] = loader.stats()["control_plane"]
        (args.out / f"rank-{record['rank']}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
