"""Exactly-once on an image corpus across a SIGKILL and a resume at another world size.

Real gloo ranks (processes forked from the tests' forkserver) read an image-text WebDataset
corpus made with Pillow (tests/imagecorpus.py). Each step every rank checks that its rows' images
are their samples' own (grid and colour), logs the sample ids with a SHA-256 of each sample's
patches (fsynced), and rank 0 saves the loader state every EVERY steps after a barrier. After a
step past a checkpoint every rank SIGKILLs itself. Another number of ranks (2 -> 3, 3 -> 2)
then resume from that checkpoint: every sample comes exactly once over the checkpointed steps and the resumed run, and
the samples delivered again (the lost steps after the checkpoint) bring the same patches.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import signal
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from distributed import free_port, start_process
from imagecorpus import color_of, images_in, options, visual_tokens, write_tar
from kill_worker import write_atomically

EVERY = 2        # rank 0 saves the loader state after steps 1, 3, 5, ...
DIE_AFTER = 3    # both ranks SIGKILL themselves after logging step index 2 (one past a save)
STALL_S = 60.0


def make_loader(root: str):
    import streamload as sl
    return sl.Loader([sl.Source(root, name="pics", images=options())], micro_batch_tokens=256,
                     micro_batches=1, epochs=1, seed=5, decode_images_in="threads")


def sample_of(sample_id: str) -> int:
    return int(sample_id.rsplit("/", 1)[1]) + 1000 * ("part-1" in sample_id)


def own_images(mb) -> dict[str, str]:
    """Per sample of the row: checks that its images are its own (count, visual tokens, colour)
    and returns the SHA-256 of its patches, in order."""
    images = mb.images() if mb.num_images else []
    bounds = mb.vision_cu_seqlens.tolist() if mb.num_images else []
    grid = mb.image_grid.tolist() if mb.num_images else []
    out = {}
    for d, sample_id in enumerate(mb.sample_ids):
        sample = sample_of(sample_id)
        mine = [k for k in range(mb.num_images) if int(mb.image_document[k]) == d]
        assert len(mine) == images_in(sample), sample_id
        tokens = [g[0] * g[1] * g[2] // mb.merge_size ** 2 for g in (grid[k] for k in mine)]
        assert tokens == visual_tokens(sample, options()), (sample_id, tokens)
        digest = hashlib.sha256()
        for j, k in enumerate(mine):
            mean = images[k].float().mean((1, 2)).numpy()
            assert np.abs(mean - color_of(sample, j)).max() < 4, (sample_id, j, mean)
            digest.update(mb.pixel_values[bounds[k]:bounds[k + 1]].numpy().tobytes())
        out[sample_id] = digest.hexdigest()
    return out


def worker(rank: int, world: int, port: int, root: str, run: str, attempt: int,
           die_after: int) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    run_dir = Path(run)
    checkpoint = run_dir / "checkpoint.json"
    saved = msgspec.json.decode(checkpoint.read_bytes()) if checkpoint.exists() else None
    log = open(run_dir / f"attempt{attempt}-rank{rank}.log", "ab")
    result = {"status": "finished"}
    loader = make_loader(root)
    try:
        if saved is not None:
            loader.load_state_dict(saved["loader"])
        for done, batch in enumerate(loader, start=1):
            digests = {}
            for mb in batch.micro_batches:
                digests.update(own_images(mb))
            log.write(msgspec.json.encode({"step": batch.step, "samples": digests}) + b"\n")
            log.flush()
            os.fsync(log.fileno())
            if done == die_after:
                os.kill(os.getpid(), signal.SIGKILL)   # no clean shutdown of any kind
            saving = (batch.step + 1) % EVERY == 0
            state = loader.state_dict() if saving else None
            dist.barrier()                              # the trainer's gradient all-reduce
            if rank == 0 and saving:
                write_atomically(checkpoint, msgspec.json.encode(
                    {"step": batch.step, "loader": state}))
    except Exception as exc:   # reported to the test
        result = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
    write_atomically(run_dir / f"result-attempt{attempt}-rank{rank}.json",
                     msgspec.json.encode(result))
    loader.close()
    dist.destroy_process_group()


def run_attempt(root: Path, run_dir: Path, attempt: int, world: int, die_after: int = 0):
    port = free_port()
    procs = [start_process(worker, r, world, port, str(root), str(run_dir), attempt, die_after)
             for r in range(world)]
    try:
        logged, quiet_since = -1, time.monotonic()
        while any(p.exitcode is None for p in procs):
            size = sum(f.stat().st_size for f in run_dir.glob(f"attempt{attempt}-*.log"))
            if size != logged:
                logged, quiet_since = size, time.monotonic()
            assert time.monotonic() - quiet_since < STALL_S, f"attempt {attempt} is stuck"
            for p in procs:
                p.join(0.2)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join(10)
    return [p.exitcode for p in procs]


def steps(run_dir: Path, attempt: int, rank: int) -> list[dict]:
    path = run_dir / f"attempt{attempt}-rank{rank}.log"
    return [msgspec.json.decode(line) for line in path.read_bytes().splitlines() if line]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("before,after", [(2, 3), (3, 2)])
def test_sigkill_then_resume_at_another_world_size_delivers_every_image_sample_exactly_once(
        tmp_path, before, after):
    root = tmp_path / "corpus"
    root.mkdir()
    write_tar(root / "part-0.tar", range(0, 40))
    write_tar(root / "part-1.tar", range(1000, 1040))
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    assert run_attempt(root, run_dir, 1, before, DIE_AFTER) == [-signal.SIGKILL] * before
    saved = msgspec.json.decode((run_dir / "checkpoint.json").read_bytes())["step"]
    assert saved == EVERY - 1 < DIE_AFTER - 1     # killed after a checkpoint, mid-epoch
    first = [s for r in range(before) for s in steps(run_dir, 1, r)]
    kept = [s for s in first if s["step"] <= saved]
    lost = [s for s in first if s["step"] > saved]
    assert lost, "the kill came right at a checkpoint"

    assert run_attempt(root, run_dir, 2, after) == [0] * after
    for r in range(after):
        result = msgspec.json.decode((run_dir / f"result-attempt2-rank{r}.json").read_bytes())
        assert result == {"status": "finished"}, (r, result)
    second = [s for r in range(after) for s in steps(run_dir, 2, r)]
    assert min(s["step"] for s in second) == saved + 1

    delivered = [i for s in kept + second for i in s["samples"]]
    assert len(delivered) == len(set(delivered)), "a sample delivered twice"
    assert len(delivered) == 80, "a sample lost"
    digests = {i: d for s in kept + second for i, d in s["samples"].items()}
    again = {i: d for s in lost for i, d in s["samples"].items()}
    assert again and all(digests[i] == d for i, d in again.items())   # the same patches
