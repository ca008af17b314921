"""Ctrl-C reaches a trainer blocked in `next(loader)`, whose hand-off queue `get()` has no
timeout (loader.py waits in one plain `SimpleQueue.get()`, not in slices).

The premise checked: on Linux (CPython 3.7+) a plain `SimpleQueue.get()` is interruptible. The
wait is a semaphore acquire; a signal delivered to the main thread makes it return EINTR, the
interpreter runs the Python-level handler (KeyboardInterrupt) and get() raises. The kernel gives
a process-directed signal to the main thread first when the main thread does not block it, and
the loader's own threads block SIGINT (loader.py), so the main thread is the one that gets it.

The child builds a Loader whose tokenizer never returns, so no batch ever comes and `next()`
waits for good. The test checks in /proc that the main thread really sits in a futex wait with
no timeout (the premise), sends SIGINT and expects KeyboardInterrupt out of `next()` at once.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from corpus import write_jsonl_source

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(sys.platform != "linux", reason="the premise is checked on Linux"),
]

REPO = Path(__file__).resolve().parents[1]
SETTLE_S = 1.0        # after "ready": long enough for next() to be waiting in get()
INTERRUPT_S = 15.0    # SIGINT to KeyboardInterrupt out of next(), at most (a loaded machine;
                      # the failure this catches never returns at all)
EXIT_S = 60.0         # SIGINT to the process gone (the loader closes at exit)

CHILD = """
import signal, sys, threading
# A shell starts background jobs with SIGINT ignored; a trainer in a terminal has it.
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {repo!r})
import streamload as sl

never = threading.Event()

def stuck(text):                         # a tokenizer call that never returns
    never.wait()
    return [1] * len(text)

loader = sl.Loader([sl.Source({corpus!r})], micro_batch_tokens=256, tokenizer=stuck,
                   epochs=None)
batches = iter(loader)
print("ready", flush=True)
try:
    next(batches)
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
    raise
print("no interrupt", flush=True)
"""

FUTEX = {"x86_64": 202, "aarch64": 98}.get(os.uname().machine)


def main_thread_syscall(pid: int) -> list[str] | None:
    """The main thread's current system call, as /proc/<pid>/syscall gives it (number, then
    arguments), or None where it cannot be read."""
    try:
        return Path(f"/proc/{pid}/task/{pid}/syscall").read_text().split()
    except OSError:
        return None


@pytest.fixture
def corpus(tmp_path):
    write_jsonl_source(tmp_path, "web", shards=2, per_shard=50, seed=3)
    return tmp_path / "web"


def test_ctrl_c_reaches_a_trainer_blocked_in_next(corpus, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD).format(repo=str(REPO), corpus=str(corpus)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        time.sleep(SETTLE_S)
        assert proc.poll() is None, proc.stderr.read()
        syscall = main_thread_syscall(proc.pid)
        if FUTEX is not None and syscall and syscall[0] != "running":
            # Blocked in futex(uaddr, op, val, timeout=NULL): an untimed semaphore wait.
            assert int(syscall[0]) == FUTEX and int(syscall[4], 16) == 0, syscall
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        line = proc.stdout.readline().strip()       # returns when the child prints, or exits
        interrupted_after = time.monotonic() - sent
        _, err = proc.communicate(timeout=EXIT_S)
    finally:
        proc.kill()
        proc.wait()
    assert line == "KeyboardInterrupt", err[-3000:]
    assert interrupted_after < INTERRUPT_S, interrupted_after
    # Uncaught, KeyboardInterrupt ends the process by SIGINT, after its traceback.
    assert proc.returncode == -signal.SIGINT, (proc.returncode, err[-3000:])
    assert "KeyboardInterrupt" in err and "in get" in err, err[-3000:]
