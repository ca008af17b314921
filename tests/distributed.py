"""Run a function on N real gloo ranks (separate processes) and collect what each returns."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, results, env, args):
    os.environ.update(env)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException as exc:  # reported to the test
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 90.0, env: dict | None = None,
              expect_errors: bool = False) -> list:
    """fn(rank, world, *args) on `world` gloo ranks; returns results by rank.

    Raises AssertionError with the rank's traceback if any rank fails (unless expect_errors,
    in which case failed ranks give ("error", message))."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, results, env or {}, args),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, tuple] = {}
    try:
        for _ in range(world):
            rank, status, value = results.get(timeout=timeout)
            out[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if expect_errors:
        return [out[r] for r in range(world)]
    failed = {r: v for r, (s, v) in out.items() if s != "ok"}
    assert not failed, "ranks failed:\n" + "\n".join(f"rank {r}: {v}" for r, v in failed.items())
    return [out[r][1] for r in range(world)]


def torchrun(script, *args, nproc: int = 2, timeout: float = 180.0, env: dict | None = None):
    """`torchrun --nproc-per-node nproc script *args` for real (python -m torch.distributed.run),
    its rendezvous on a free loopback port; returns the CompletedProcess (text output).
    `timeout` is generous: a loaded machine starts torch slowly, and only a hang should fail."""
    import subprocess
    import sys
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--local-addr", "127.0.0.1",
               str(script), *[str(a) for a in args]]
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environ)
