"""The background thread: errors reach the trainer, and close / GC / Ctrl-C never hang."""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import weakref

import pytest

import streamload as sl
from corpus import write_jsonl_source

pytestmark = pytest.mark.timeout(60)


def loop_threads():
    return [t for t in threading.enumerate() if t.name == "streamload-loop" and t.is_alive()]


def wait_until(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def corpus(tmp_path):
    write_jsonl_source(tmp_path, "web", shards=4, per_shard=300, seed=1)
    return tmp_path / "web"


def test_close_mid_epoch_stops_the_thread(corpus):
    loader = sl.Loader([sl.Source(str(corpus))], micro_batch_tokens=256, micro_batches=1, epochs=None)
    next(iter(loader))
    assert loop_threads()
    started = time.monotonic()
    loader.close()
    assert time.monotonic() - started < 30   # no timeout waited out (a loaded machine is slow)
    assert wait_until(lambda: not loop_threads())
    with pytest.raises(sl.UsageError, match="closed Loader"):   # not a silent end of data
        next(loader)
    loader.close()   # twice is fine


def test_an_epoch_ends_with_stop_iteration_and_a_closed_loader_refuses_next(corpus):
    with sl.Loader([sl.Source(str(corpus))], micro_batch_tokens=4096, epochs=1) as loader:
        assert len(list(loader)) > 0
        with pytest.raises(StopIteration):   # the iterator protocol's end, again and again
            next(loader)
    with pytest.raises(sl.UsageError, match="closed Loader"):
        next(loader)


def test_context_manager_and_break(corpus):
    with sl.Loader([sl.Source(str(corpus))], micro_batch_tokens=256, epochs=None) as loader:
        for step, _ in enumerate(loader):
            if step == 3:
                break
    assert wait_until(lambda: not loop_threads())


def test_a_batch_the_trainer_is_done_with_is_freed_off_its_thread(corpus):
    """next() hands the last batch it returned to the waker thread, which drops it there once
    the loop's variable has moved on: its tensors are freed, and not on the trainer's thread
    (`for batch in loader` holds the last one until next() returns). A batch the trainer
    keeps stays whole. The loop and the waker stop with the loader."""
    freed_on = []
    with sl.Loader([sl.Source(str(corpus))], micro_batch_tokens=256, epochs=None) as loader:
        it = iter(loader)
        for batch in it:   # as a training loop holds it: until next() has returned
            if batch.step == 0:
                weakref.finalize(batch, lambda: freed_on.append(threading.current_thread().name))
            if batch.step == 1:
                assert wait_until(lambda: freed_on)
                assert freed_on == ["streamload-waker"]
                kept = batch
            if batch.step == 3:
                break
        assert freed_on == ["streamload-waker"]
        next(it)
        assert kept.micro_batches[0].num_tokens > 0 and kept.step == 1   # still whole
    assert wait_until(lambda: not [t for t in threading.enumerate()
                                   if t.name in ("streamload-loop", "streamload-waker")])


def test_garbage_collection_stops_the_thread(corpus):
    loader = sl.Loader([sl.Source(str(corpus))], micro_batch_tokens=256, epochs=None)
    next(iter(loader))
    del loader
    gc.collect()
    assert wait_until(lambda: not loop_threads())


def test_background_error_keeps_its_traceback(corpus):
    def exploding_tokenizer(text):
        raise ValueError("tokenizer exploded on purpose")

    with sl.Loader([sl.Source(str(corpus))], micro_batch_tokens=256, epochs=1,
                   tokenizer=exploding_tokenizer) as loader:
        with pytest.raises(sl.DataError, match="exploded on purpose") as info:
            next(iter(loader))
    assert "web" in str(info.value) and "record 0" in str(info.value)   # names the document
    frames = "".join(traceback.format_exception(info.value))
    assert "exploding_tokenizer" in frames   # the original frame, not just the re-raise


def test_ctrl_c_interrupts_a_waiting_trainer(corpus, tmp_path):
    script = tmp_path / "interrupt.py"
    script.write_text(textwrap.dedent(f"""
        import signal, sys, time
        # A shell starts background jobs with SIGINT ignored; a trainer in a terminal has it.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.path.insert(0, {os.getcwd()!r})
        import streamload as sl
        def slow(text):
            time.sleep(0.3)           # the trainer waits on the queue meanwhile
            return [1] * len(text)
        try:
            with sl.Loader([sl.Source({str(corpus)!r})], micro_batch_tokens=4096,
                           tokenizer=slow, epochs=None) as loader:
                print("iterating", flush=True)
                for batch in loader:
                    pass
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(3)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "iterating"
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 3 and "interrupted" in out
