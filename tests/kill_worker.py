"""One rank of a small training job, for tests/test_kill.py (not collected by pytest), which runs
`main(argv)` in a process of its own; by hand:

    python tests/kill_worker.py --rank R --world W --port P --corpus DIR --run-dir DIR --attempt A

It joins a gloo job on tcp://127.0.0.1:P, resumes the loader from RUN_DIR/checkpoint.json when
there is one, and iterates one epoch. For every step it appends a line to RUN_DIR/rank<R>.log:
{"attempt": A, "step": s, "time": t, "ids": [...]}, flushed and fsynced before the step counts
as done; at checkpoint steps the line also holds the SHA-256 of this rank's loader state. Then
it "trains" (sleeps), waits for every rank at a barrier on the trainer's own process group (as a
gradient all-reduce would), and every --every steps rank 0 saves the loader's state with the
step number: msgspec JSON written to a temporary file, fsynced, then os.replace'd over
the checkpoint. Every rank holds the same loader state, so saving rank 0's copy is enough.

--die-after N ends this process abruptly (os._exit) after N steps, --no-barrier leaves the
trainer's barrier out, so that only the loader's own collectives connect the ranks, and
--pause-at S --pause T makes this rank spend T more seconds after step S (after the barrier,
where a checkpoint is saved), while the other ranks go on to the next step. The outcome
("finished" or the error and when it came) goes to RUN_DIR/result-rank<R>-attempt<A>.json.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import sys
import time
from pathlib import Path


def make_loader(corpus: Path, collective_timeout_s: float):
    import streamload as sl
    return sl.Loader([sl.Source(str(corpus / "web"), weight=0.5),
                      sl.Source(str(corpus / "code"), weight=0.3),
                      sl.Source(str(corpus / "math"), weight=0.2)],
                     micro_batch_tokens=512, micro_batches=2, epochs=1, seed=7, chunk_bytes=4096,
                     collective_timeout_s=collective_timeout_s)


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    for name in ("--rank", "--world", "--port", "--attempt"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--sleep", type=float, default=0.02)
    parser.add_argument("--collective-timeout", type=float, default=120.0)   # a loaded machine
    parser.add_argument("--die-after", type=int, default=0)
    parser.add_argument("--no-barrier", action="store_true")
    parser.add_argument("--pause-at", type=int, default=-1)
    parser.add_argument("--pause", type=float, default=0.0)
    args = parser.parse_args(argv)

    import msgspec
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=300))
    rank, run = args.rank, args.run_dir
    checkpoint = run / "checkpoint.json"
    saved = msgspec.json.decode(checkpoint.read_bytes()) if checkpoint.exists() else None

    log_path = run / f"rank{rank}.log"
    log = open(log_path, "ab")
    if log.tell() and not log_path.read_bytes().endswith(b"\n"):
        log.write(b"\n")   # a line cut short by the last kill stays on its own

    def log_line(record: dict) -> None:
        log.write(msgspec.json.encode(record) + b"\n")
        log.flush()
        os.fsync(log.fileno())

    log_line({"attempt": args.attempt, "event": "start",
              "resumed_from": saved["step"] if saved else -1, "time": time.time()})
    result: dict = {"status": "finished"}
    loader = make_loader(args.corpus, args.collective_timeout)
    try:
        if saved is not None:
            loader.load_state_dict(saved["loader"])
        for done, batch in enumerate(loader, start=1):
            ids = [i for mb in batch.micro_batches for i in mb.sample_ids]
            record = {"attempt": args.attempt, "step": batch.step, "time": time.time(), "ids": ids}
            saving = (batch.step + 1) % args.every == 0
            if saving:   # every rank logs a digest of its state: the test checks they agree
                state = loader.state_dict()
                record["state_sha256"] = hashlib.sha256(state["streamload"].encode()).hexdigest()
            log_line(record)
            if done == args.die_after:
                os._exit(1)          # no clean shutdown: sockets close as the process goes
            time.sleep(args.sleep)   # the training step
            if not args.no_barrier:
                dist.barrier()       # every rank has finished (and logged) this step
            if batch.step == args.pause_at:
                time.sleep(args.pause)   # a slow checkpoint save or evaluation on this rank only
            if rank == 0 and saving:
                write_atomically(checkpoint, msgspec.json.encode(
                    {"step": batch.step, "loader": state}))
    except Exception as exc:   # reported to the driver
        result = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
    result["time"] = time.time()
    write_atomically(run / f"result-rank{rank}-attempt{args.attempt}.json",
                     msgspec.json.encode(result))
    loader.close()
    if result["status"] == "finished":
        dist.destroy_process_group()
        return 0
    return 3


if __name__ == "__main__":
    sys.exit(main())
