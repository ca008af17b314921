"""Run a function on N real gloo ranks (separate processes) and collect what each returns.

The ranks are forked from a forkserver that imported torch and streamload once per session, so
a rank starts in milliseconds instead of paying the seconds of a fresh `import torch` each time
(with spawn, that import was most of the suite's time). The forkserver is a clean process of
its own (no pytest threads, no loop), the usual safe way to fork with torch, and each rank gets
the test's current environment, as a spawned one would. STREAMLOAD_TEST_START=spawn goes back
to spawn.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback

START_METHOD = os.environ.get("STREAMLOAD_TEST_START", "forkserver")
# A hang guard, scaled like the tests' own timeouts (conftest.py): a loaded machine is slower.
TIMEOUT_SCALE = float(os.environ.get("STREAMLOAD_TIMEOUT_SCALE", "3"))
PRELOAD = ["torch", "torch.distributed", "numpy", "msgspec", "streamload", "streamload.loader"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def context():
    """The multiprocessing context the tests' processes start from (the preloaded forkserver)."""
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)   # read once, when the server starts
    return ctx


def start_process(target, *args, daemon: bool = True):
    """A started process running target(*args), forked like the ranks (torch already imported),
    with the test's environment."""
    process = context().Process(target=_with_environment, args=(dict(os.environ), target, args),
                                daemon=daemon)
    process.start()
    return process


def _with_environment(env, target, args):
    os.environ.clear()
    os.environ.update(env)
    target(*args)


def _entry(fn, rank, world, port, results, env, args):
    os.environ.clear()    # the test's environment now, not the forkserver's at its start
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


def _drain(results, out: dict, wait_s: float, ranks: list[int]) -> bool:
    """Read results for up to `wait_s` until `ranks` have all given one; whether they did."""
    end = time.monotonic() + wait_s
    while any(r not in out for r in ranks) and time.monotonic() < end:
        try:
            rank, status, value = results.get(timeout=max(0.05, end - time.monotonic()))
            out[rank] = (status, value)
        except queue.Empty:
            break
    return all(r in out for r in ranks)


def run_ranks(fn, world: int, *args, timeout: float = 90.0, env: dict | None = None,
              expect_errors: bool = False) -> list:
    """fn(rank, world, *args) on `world` gloo ranks; returns results by rank.

    Raises AssertionError with the rank's traceback if any rank fails (unless expect_errors,
    in which case failed ranks give ("error", message))."""
    ctx = context()
    results = ctx.Queue()
    port = free_port()
    env = {**os.environ, **(env or {})}
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, results, env, args),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout * TIMEOUT_SCALE
    try:
        while len(out) < world:
            try:
                rank, status, value = results.get(timeout=1.0)
                out[rank] = (status, value)
                continue
            except queue.Empty:
                pass
            # A rank that died without a word (killed, crashed in C++) fails the run now, not
            # at the deadline; one that is merely slow is waited for.
            gone = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in out]
            if gone and not _drain(results, out, 5.0, gone):
                raise AssertionError(f"ranks {gone} exited without a result "
                                     f"(exit codes {[procs[r].exitcode for r in gone]})")
            if time.monotonic() > deadline:
                raise AssertionError(f"ranks {sorted(set(range(world)) - set(out))} gave no "
                                     f"result within {timeout * TIMEOUT_SCALE:.0f} s")
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


def torchrun_nodes(script, *args, nodes: int = 2, nproc: int = 2, timeout: float = 180.0,
                   env: dict | None = None) -> list:
    """`nodes` torchrun processes on this machine, as on `nodes` hosts: each
    `torchrun --nnodes nodes --nproc-per-node nproc --node-rank i --rdzv-backend c10d
    --rdzv-endpoint 127.0.0.1:PORT script *args`, started together; returns their
    CompletedProcess-like results (returncode, stdout, stderr; text), by node rank.

    The first process hosts the rendezvous store (`--rdzv-conf is_host=1`, as the node whose
    hostname is the endpoint's would), the others connect to it (`is_host=0`): on one machine
    every process's address matches the endpoint, and the one that hosts must be a fixed one.
    c10d numbers the nodes itself (sorted node descriptors), not by --node-rank. A process still
    running at `timeout` is killed with its workers, and its result says so (returncode -9)."""
    import subprocess
    import sys
    from types import SimpleNamespace
    port = free_port()
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    procs = []
    for node in range(nodes):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
                   "--nproc-per-node", str(nproc), "--node-rank", str(node),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                   "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", "127.0.0.1",
                   str(script), *[str(a) for a in args]]
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=environ, start_new_session=True))
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_session(p)
                out, err = p.communicate()
                err += f"\n[killed: still running after {timeout:.0f} s]"
            results.append(SimpleNamespace(returncode=p.returncode, stdout=out, stderr=err))
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_session(p)
                p.wait()
    return results


def _kill_session(process) -> None:
    """SIGKILL a torchrun started with start_new_session=True, and its workers with it."""
    import signal
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
