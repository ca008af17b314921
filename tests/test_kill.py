"""Kill -9 at random steps, restart from the last checkpoint: nothing lost, and the only repeats
are the steps after the last checkpoint. And a rank that dies or freezes makes the other fail
with a named error within collective_timeout_s, instead of hanging.

The ranks are real processes (tests/kill_worker.py) in a 2-rank gloo job on 127.0.0.1, forked
from the tests' forkserver (torch already imported: a launch costs no fresh `import torch`).

Nothing here waits a fixed time for a job: a wait fails only when the job stops making progress
(no step logged for STALL_S), so a loaded machine makes these tests slower, not red. Bounds on
how fast a rank notices a dead peer have the same slack.
"""
from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from corpus import base_ids, write_jsonl_source, write_token_source
from distributed import free_port, start_process
WORLD = 2
EVERY = 3          # rank 0 saves the loader state every EVERY steps
STALL_S = 60.0     # a job that logs nothing for this long is stuck (start-up included)
SLACK_S = 30.0     # how much later than its timeout a loaded machine may notice a dead peer


@pytest.fixture
def corpus(tmp_path) -> tuple[Path, set[str]]:
    root = tmp_path / "corpus"
    ids = write_jsonl_source(root, "web", shards=4, per_shard=30, compression="zst", seed=1)
    ids |= write_jsonl_source(root, "code", shards=2, per_shard=20, median=500, compression="gz",
                              seed=2)
    ids |= write_token_source(root, "math", shards=2, per_shard=20, seed=3)
    return root, ids


def _worker_main(output: str, argv: list[str]) -> None:
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    import kill_worker
    sys.exit(kill_worker.main(argv))


class Rank:
    """One rank: `kill_worker.main(argv)` in its own process, its output to `output`; the
    part of subprocess.Popen the tests use (poll, wait, returncode, send_signal)."""

    def __init__(self, output: Path, argv: list[str]):
        self.process = start_process(_worker_main, str(output), argv)

    @property
    def returncode(self):
        return self.process.exitcode     # -N when signal N ended it, as with Popen

    def poll(self):
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired("kill_worker", timeout)
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.process.pid, sig)


class Job:
    """The ranks of one attempt, as subprocesses."""

    def __init__(self, corpus: Path, run_dir: Path, attempt: int, *args: str,
                 per_rank: dict[int, list[str]] | None = None):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir, self.attempt = run_dir, attempt
        port = free_port()
        self.procs = []
        for rank in range(WORLD):
            argv = ["--rank", str(rank), "--world", str(WORLD), "--port", str(port),
                    "--corpus", str(corpus), "--run-dir", str(run_dir), "--attempt", str(attempt),
                    "--every", str(EVERY), *args, *(per_rank or {}).get(rank, [])]
            self.procs.append(Rank(run_dir / f"output-rank{rank}-attempt{attempt}.txt", argv))

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.procs:
            proc.wait(10)

    def progress(self) -> int:
        """Bytes the ranks have logged: it grows with every step."""
        return sum(path.stat().st_size for path in self.run_dir.glob("rank*.log"))

    def wait(self, stall: float = STALL_S, procs=None) -> list[int]:
        """The exit codes, once every rank (of `procs`) has ended. Fails only when the job
        stopped making progress for `stall` seconds: slow is not stuck."""
        procs = self.procs if procs is None else procs
        logged, quiet_since = -1, time.monotonic()
        for proc in procs:
            while True:
                try:
                    proc.wait(0.5)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if self.progress() != logged:
                    logged, quiet_since = self.progress(), time.monotonic()
                elif time.monotonic() - quiet_since > stall:
                    self.kill()
                    raise AssertionError(f"attempt {self.attempt} logged nothing for {stall} s:\n"
                                         + self.output()) from None
        return [proc.returncode for proc in procs]

    def output(self) -> str:
        return "\n".join(
            f"--- rank {r}:\n" + (self.run_dir / f"output-rank{r}-attempt{self.attempt}.txt")
            .read_text(errors="replace")[-3000:] for r in range(WORLD))

    def result(self, rank: int) -> dict:
        path = self.run_dir / f"result-rank{rank}-attempt{self.attempt}.json"
        assert path.exists(), f"rank {rank} wrote no result:\n{self.output()}"
        return msgspec.json.decode(path.read_bytes())


@pytest.fixture
def launch(corpus):
    """launch(run_dir, attempt, *args) starts a job; whatever still runs at the end is killed,
    even when the test fails or times out."""
    started: list[Job] = []

    def start(run_dir: Path, attempt: int, *args: str, **kwargs) -> Job:
        job = Job(corpus[0], run_dir, attempt, *args, **kwargs)
        started.append(job)
        return job

    yield start
    for job in started:
        job.kill()


def read_log(run_dir: Path, rank: int) -> list[dict]:
    """Every complete line of a rank's log (a line cut short by SIGKILL is left out)."""
    path = run_dir / f"rank{rank}.log"
    lines = []
    for raw in path.read_bytes().split(b"\n") if path.exists() else []:
        try:
            lines.append(msgspec.json.decode(raw))
        except msgspec.DecodeError:
            continue
    return lines


def steps_of(run_dir: Path, rank: int, attempt: int) -> list[dict]:
    return [r for r in read_log(run_dir, rank) if r.get("attempt") == attempt and "step" in r]


def saved_step(run_dir: Path) -> int:
    path = run_dir / "checkpoint.json"
    return msgspec.json.decode(path.read_bytes())["step"] if path.exists() else -1


def wait_for_step(job: Job, step: int, stall: float = STALL_S) -> None:
    """Until rank 0 has logged `step`; fails when the job ends first, or logs nothing for
    `stall` seconds."""
    logged, quiet_since = -1, time.monotonic()
    while True:
        lines = steps_of(job.run_dir, 0, job.attempt)
        if lines and lines[-1]["step"] >= step:
            return
        assert all(p.poll() is None for p in job.procs), \
            f"attempt {job.attempt} ended before step {step}:\n{job.output()}"
        if job.progress() != logged:
            logged, quiet_since = job.progress(), time.monotonic()
        elif time.monotonic() - quiet_since > stall:
            job.kill()
            raise AssertionError(f"attempt {job.attempt} did not reach step {step}:\n"
                                 + job.output())
        time.sleep(0.01)   # another process's file: nothing to wait on but its size


@pytest.mark.timeout(200)   # about 20 s idle, 95 s at load 11 on 2 cores (scaled: conftest)
def test_sigkill_at_random_steps_repeats_only_the_steps_after_the_last_checkpoint(
        tmp_path, corpus, launch):
    _, expected = corpus
    rng = random.Random(20240611)

    # An uninterrupted run: what every step must deliver to every rank.
    reference = launch(tmp_path / "reference", 0)
    assert reference.wait() == [0] * WORLD, reference.output()
    ref = {(r, line["step"]): line["ids"] for r in range(WORLD)
           for line in steps_of(tmp_path / "reference", r, 0)}
    total = len(ref) // WORLD
    assert sorted(ref) == [(r, s) for r in range(WORLD) for s in range(total)]
    assert total >= 25, f"only {total} steps: the corpus is too small to kill mid-epoch"

    # Three kills at random steps, each attempt resuming from the last checkpoint.
    run = tmp_path / "killed"
    targets = sorted(rng.sample(range(3, total - 6), 3))
    resumed_from = {}
    for attempt, target in enumerate(targets):
        resumed_from[attempt] = saved_step(run)
        job = launch(run, attempt)
        wait_for_step(job, target)
        time.sleep(rng.uniform(0.0, 0.1))      # somewhere inside a step, or in a checkpoint
        job.kill()
        assert all(p.returncode == -signal.SIGKILL for p in job.procs)
    final = len(targets)
    resumed_from[final] = saved_step(run)
    job = launch(run, final)
    assert job.wait() == [0] * WORLD, job.output()
    assert all(job.result(r)["status"] == "finished" for r in range(WORLD))

    kept: list[str] = []
    repeated: list[tuple[int, int, int]] = []     # (attempt, rank, step) delivered again later
    digests: dict[tuple[int, int], set[str]] = {}
    for rank in range(WORLD):
        starts = [r for r in read_log(run, rank) if r.get("event") == "start"]
        assert [(s["attempt"], s["resumed_from"]) for s in starts] == sorted(resumed_from.items())
        for attempt in range(final + 1):
            lines = steps_of(run, rank, attempt)
            steps = [line["step"] for line in lines]
            # Each attempt starts right after the checkpoint it resumed from, step by step.
            first = resumed_from[attempt] + 1
            assert steps == list(range(first, first + len(steps))), (rank, attempt, steps)
            # Everything a rank got is what the uninterrupted run gave it at that step: the
            # resumed run is identical, and so is every repeat.
            for line in lines:
                assert line["ids"] == ref[(rank, line["step"])], (rank, attempt, line["step"], resumed_from, str(run))
                if "state_sha256" in line:
                    digests.setdefault((attempt, line["step"]), set()).add(line["state_sha256"])
            # Steps after the checkpoint that the next attempt resumed from come again.
            cut = resumed_from[attempt + 1] if attempt < final else total
            kept += [i for line in lines if line["step"] <= cut for i in line["ids"]]
            repeated += [(attempt, rank, line["step"]) for line in lines if line["step"] > cut]
            if attempt < final:
                # A kill costs at most the steps since the last save: rank 0 saves right after
                # the barrier of a step (rank 1 may be one step further).
                assert max(steps, default=cut) - cut <= EVERY + rank, (rank, attempt, steps, cut)
    # Once each: the whole epoch, nothing lost, nothing twice.
    assert len(kept) == len(set(kept)), "a sample was delivered twice before a checkpoint"
    assert set(base_ids(kept)) == expected, "a sample was lost"
    assert repeated, "no kill landed after a checkpoint: nothing was tested"
    # Every rank held the same state at every checkpoint step, so rank 0's copy was enough.
    assert digests and all(len(d) == 1 for d in digests.values()), digests
    saved = msgspec.json.decode((run / "checkpoint.json").read_bytes())
    assert digests[(final, saved["step"])] == {
        hashlib.sha256(saved["loader"]["streamload"].encode()).hexdigest()}


@pytest.mark.timeout(100)
def test_a_rank_that_dies_makes_the_other_fail_within_the_collective_timeout(tmp_path, launch):
    """Rank 1 exits abruptly mid-epoch (os._exit: no clean shutdown). Rank 0, which only meets
    it in the loader's collectives, gets a DistributedError instead of hanging."""
    run = tmp_path / "dies"
    job = launch(run, 0, "--no-barrier", "--collective-timeout", "5",
              per_rank={1: ["--die-after", "3"]})
    codes = job.wait()
    assert codes[1] == 1, job.output()
    assert codes[0] == 3, job.output()
    error = job.result(0)["error"]
    assert error.startswith("DistributedError: rank 0: collective"), error
    assert "another rank may have died or stalled for more than 5 s" in error, error
    died = steps_of(run, 1, 0)[-1]["time"]
    assert job.result(0)["time"] - died < 5 + SLACK_S, "rank 0 took too long to notice"


@pytest.mark.timeout(100)
def test_a_rank_that_freezes_makes_the_other_fail_after_the_collective_timeout(tmp_path, launch):
    """Rank 1 stops (SIGSTOP) with its sockets open: only the timeout can tell rank 0."""
    run = tmp_path / "freezes"
    job = launch(run, 0, "--no-barrier", "--collective-timeout", "3", "--sleep", "0.05")
    wait_for_step(job, 3)
    job.procs[1].send_signal(signal.SIGSTOP)
    frozen = time.time()
    # Rank 1 logs nothing more: rank 0 must end within the timeout and the slack.
    code, = job.wait(stall=3 + SLACK_S, procs=job.procs[:1])
    assert code == 3, job.output()
    result = job.result(0)
    assert result["error"].startswith("DistributedError: rank 0: collective"), result
    assert "stalled for more than 3 s" in result["error"], result
    # Not before the timeout: rank 0's wait began before the freeze, by as much as rank 1
    # lagged behind it, which a loaded machine makes up to a couple of seconds.
    waited = result["time"] - frozen
    assert 0.5 <= waited < 3 + SLACK_S, waited


@pytest.mark.timeout(100)
def test_a_rank_that_is_busy_longer_than_the_collective_timeout_does_not_fail_the_job(
        tmp_path, launch):
    """Only a dead or frozen process should trip collective_timeout_s, not a trainer that is
    busy between two steps on one rank (rank 0 saving a checkpoint, say) while the others wait
    for it at their next gradient all-reduce."""
    run = tmp_path / "busy"
    job = launch(run, 0, "--collective-timeout", "2",
                 per_rank={0: ["--pause-at", "3", "--pause", "4.5"]})
    codes = job.wait()
    results = [job.result(r) for r in range(WORLD)]
    assert codes == [0] * WORLD and all(r["status"] == "finished" for r in results), results
