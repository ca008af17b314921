"""Memory budget and adaptive per-source concurrency.

Memory: the loader's `memory_budget` (bytes per rank) pays first for every source's buffer (two
head windows and a row), sized step by step from the source's share of the job and the ranks
that still hold its data (`MemoryPlan`); the rest bounds each source's bytes in flight (fetched
ranges not yet decoded, decoded items not yet buffered), enforced by a `MemoryGate`.

Concurrency: each source has two knobs, the shards it reads (and decodes) at once and the byte
ranges in flight per shard. Every few steps, a source that made a step wait gets more of both
(up to what its memory allows), and a source whose buffer sat full gets less, so a slow or heavy
source does not starve the step and a light one does not hog memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..config import LoaderConfig
from ..errors import ConfigError
from ..plan.types import Candidates
from .changes import Changes

TOKEN_BYTES = 4           # buffered tokens: at most int32 (byte tokens are uint8): an upper bound
ITEM_OVERHEAD_BYTES = 160  # an Item object, its array header


@dataclass
class SourceBudget:
    capacity_tokens: int   # buffer capacity
    window_tokens: int     # head window offered to the planner
    inflight_bytes: int    # bytes fetched or decoded but not yet buffered


DEFAULT_MEMORY_BUDGET = 32 << 20
RANGES_PER_SOURCE = 2   # what the default budget allows in flight per source, at least


def _window_steps(config: LoaderConfig) -> float:
    # Lookahead plans over exactly W steps: deeper windows would age items past the W-step
    # deferral bound before their turn. Other planners see `window_factor` steps of choice.
    return config.lookahead if config.planner == "lookahead" else config.window_factor


class MemoryPlan:
    """How one rank's `memory_budget` is split between its sources' buffers and bytes in flight,
    step by step. Pure: every input is a deterministic function of the job's history, so a
    rank's windows (and so the plans) do not depend on fetch timing.

    A source's head window must offer the planner `window_steps` steps of its share of the
    *whole job's* step, R·M·C tokens, split over the ranks that still hold its data:

        window = ceil(window_steps · share · R·M·C / holders) + C

    (for the lookahead planner exactly W steps, at least a row: its items must not wait longer
    than that).

    With every rank holding data that is the familiar window_steps · share · M·C + C; a source
    with one shard at R ranks gets an R times deeper window on the one rank that reads it, so
    its supply does not depend on how its shards are placed. Shares are the mix's shares now
    (renormalized when a source runs out, following the schedule), so a source that ran out
    or whose share fell gives its memory back, and the others' windows grow within the
    budget. The buffer holds two windows and a row (or `buffer_tokens`); what the buffers leave
    of the budget bounds the bytes in flight, half evenly and half by share. When the budget
    cannot hold every window, windows above one row shrink in proportion.
    """

    def __init__(self, config: LoaderConfig, max_shares: np.ndarray, names: list[str], ranks: int):
        self.config, self.names, self.ranks = config, list(names), ranks
        self.steps = _window_steps(config)
        shares = np.asarray(max_shares, dtype=np.float64)
        shares = shares / shares.sum()
        S = len(shares)
        windows = self._windows(shares, np.full(S, ranks), np.ones(S, dtype=bool))
        capacities = self._capacities(windows)
        budget = config.memory_budget
        if budget is None:   # 32 MiB, or the least that gives every source its buffer and 2 ranges
            budget = max([DEFAULT_MEMORY_BUDGET] + [
                int(np.ceil((cap * TOKEN_BYTES + RANGES_PER_SOURCE * config.chunk_bytes)
                            / (0.5 / S + 0.5 * share))) for cap, share in zip(capacities, shares)])
        self.budget = int(budget)
        # The start-up split (each source's largest share, every rank holding data) must fit:
        # a budget too small for the geometry fails when the Loader is built.
        for name, share, capacity in zip(names, shares, capacities):
            source_bytes = self.budget * (0.5 / S + 0.5 * share)
            if source_bytes - capacity * TOKEN_BYTES < config.chunk_bytes:
                need = capacity * TOKEN_BYTES + config.chunk_bytes
                raise ConfigError(
                    f"memory_budget: {self.budget} bytes leaves source {name!r} "
                    f"{int(source_bytes)} bytes, less than it needs for its buffer plus one "
                    f"fetched range ({need} bytes); raise memory_budget or lower chunk_bytes, "
                    f"micro_batch_tokens or window_factor")

    def _windows(self, shares: np.ndarray, holders: np.ndarray, held: np.ndarray) -> np.ndarray:
        C, M = self.config.micro_batch_tokens, self.config.micro_batches
        job = np.ceil(self.steps * shares * self.ranks * M * C / np.maximum(holders, 1))
        if self.config.planner == "lookahead":   # exactly W steps (at least a row): a row more
            # made a small source's window W + C / (share · M·C) steps deep at small R·M, so
            # its items fell overdue and went past its quota (mix 0.06 off; 0.03 without)
            return np.where(held, np.maximum(job.astype(np.int64), C), C)
        return np.where(held, job.astype(np.int64) + C, C)

    def _capacities(self, windows: np.ndarray) -> np.ndarray:
        if self.config.buffer_tokens is not None:
            return np.maximum(self.config.buffer_tokens, windows)
        return 2 * windows + self.config.micro_batch_tokens   # the planner's choice + a step ahead

    def budgets(self, shares: np.ndarray, holders: np.ndarray, held: np.ndarray) -> list[SourceBudget]:
        """This rank's buffers for the next step. `shares[s]`: the mix's share of s now (0 once
        it has no data); `holders[s]`: ranks that still hold data of s; `held[s]`: this rank
        is one of them."""
        shares = np.asarray(shares, dtype=np.float64)
        held = np.asarray(held, dtype=bool)
        C, chunk = self.config.micro_batch_tokens, self.config.chunk_bytes
        windows = self._windows(shares, np.asarray(holders), held)
        capacities = self._capacities(windows)
        room = self.budget - chunk * max(int(held.sum()), 1)   # a range in flight per source
        floor = self._capacities(np.full(windows.shape, C))
        want = float((capacities * TOKEN_BYTES).sum())
        if want > room:   # shrink every window above one row in proportion
            spare = float(((capacities - floor) * TOKEN_BYTES).sum())
            scale = max(room - float((floor * TOKEN_BYTES).sum()), 0.0) / max(spare, 1.0)
            windows = C + np.floor((windows - C) * min(scale, 1.0)).astype(np.int64)
            capacities = self._capacities(windows)
        left = max(self.budget - int((capacities * TOKEN_BYTES).sum()), 0)
        weight = np.where(held, shares, 0.0)
        split = np.where(held, 0.5 / max(int(held.sum()), 1), 0.0) + \
            (0.5 * weight / weight.sum() if weight.sum() > 0 else 0.0)
        inflight = np.maximum((left * split).astype(np.int64), np.where(held, chunk, 0))
        return [SourceBudget(int(c), int(w), int(i))
                for c, w, i in zip(capacities, windows, inflight)]

    def for_rank(self, rank: int, shares: np.ndarray, holding: np.ndarray) -> list[SourceBudget]:
        """`budgets` from `holding` [R, S]: which ranks hold data of which source."""
        holding = np.asarray(holding, dtype=bool)
        return self.budgets(shares, holding.sum(axis=0), holding[rank])

    @staticmethod
    def holding_after(c: Candidates, take: np.ndarray, done: np.ndarray) -> np.ndarray:
        """[R, S]: after a step that took `take`, which ranks still hold data of each source:
        items left in the window, or more to come (`done[r, s]` false). Both are functions of
        the gathered windows and the plan, so every rank derives the same answer."""
        R, S = done.shape
        left = np.ones(len(c), dtype=bool)
        left[take] = False
        remaining = np.bincount(c.rank[left].astype(np.int64) * S + c.source[left],
                                minlength=R * S).reshape(R, S)
        return (remaining > 0) | ~np.asarray(done, dtype=bool)

    def initial(self, max_shares: np.ndarray) -> list[SourceBudget]:
        """The start-up split: every rank holds data, each source at its largest share."""
        shares = np.asarray(max_shares, dtype=np.float64)
        S = shares.size
        return self.budgets(shares / shares.sum(), np.full(S, self.ranks), np.ones(S, dtype=bool))


class MemoryGate:
    """Bytes in flight for one source, by owner (a shard).

    A fetch reserves, before it starts, what its range will hold once decoded (its size times
    the largest decoded/raw ratio seen so far, `expansion`), and `acquire` waits while that
    would exceed the limit. Decoded items are then accounted at their true size (`settle`,
    which never waits: the bytes already exist) until they reach the buffer. One exception
    keeps the ordered pipeline from deadlocking: the shard being drained (`head`) may always
    start a fetch while it holds nothing. So the bound is the limit plus one range of the head
    shard, plus whatever a range decodes to beyond the expansion seen so far."""

    def __init__(self, limit: int, expansion: float = 4.0):
        self.limit = limit
        self.expansion = expansion
        self.observed = False   # until a range has been decoded, fetch one at a time
        self.used = 0
        self.peak = 0
        self.excess_peak = 0    # the most `used` went past the limit in force at the time
        self.head = None
        self._by_owner: dict = {}
        self._changes = Changes()

    def set_limit(self, limit: int) -> None:
        """A new limit (the memory plan moved bytes between sources); waiters check again."""
        self.limit = limit
        self._changes.notify()

    def reservation(self, raw_bytes: int) -> int:
        return int(raw_bytes * self.expansion)

    async def settle(self, reserved: int, raw_bytes: int, decoded: int, owner) -> None:
        """Swap a fetch's reservation for the decoded bytes it produced."""
        if raw_bytes:
            self.expansion = max(self.expansion, decoded / raw_bytes)
            self.observed = True
        self._add(decoded - reserved, owner)
        self._changes.notify()

    def _add(self, n: int, owner) -> None:
        self.used += n
        left = self._by_owner.get(owner, 0) + n
        if left:
            self._by_owner[owner] = left
        else:
            self._by_owner.pop(owner, None)
        self.peak = max(self.peak, self.used)
        self.excess_peak = max(self.excess_peak, self.used - self.limit)

    def _may_take(self, n: int, owner) -> bool:
        if self.used == 0 or (self.observed and self.used + n <= self.limit):
            return True
        return owner == self.head and self._by_owner.get(owner, 0) == 0

    async def acquire(self, n: int, owner) -> None:
        while not self._may_take(n, owner):
            await self._changes.wait()
        self._add(n, owner)

    async def release(self, n: int, owner) -> None:
        self._add(-n, owner)
        self._changes.notify()

    async def set_head(self, owner) -> None:
        self.head = owner
        self._changes.notify()


@dataclass
class Knobs:
    """A source's concurrency, read by its fetcher each time it starts a shard or a range."""
    shards: int
    readahead: int
    max_shards: int
    max_readahead: int
    history: list = field(default_factory=list)   # (step, shards, readahead) changes

    def grow(self, step: int) -> bool:
        if self.shards >= self.max_shards and self.readahead >= self.max_readahead:
            return False
        self.shards = min(self.max_shards, self.shards * 2)
        self.readahead = min(self.max_readahead, self.readahead * 2)
        self.history.append((step, self.shards, self.readahead))
        return True

    def shrink(self, step: int) -> bool:
        if self.shards <= 1 and self.readahead <= 1:
            return False
        if self.readahead >= self.shards:
            self.readahead = max(1, self.readahead - 1)
        else:
            self.shards = max(1, self.shards - 1)
        self.history.append((step, self.shards, self.readahead))
        return True


class Autoscaler:
    """Every `every` steps: grow the knobs of sources that made steps wait, shrink the knobs
    of sources whose buffers sat full (their producer was blocked) and never made one wait."""

    def __init__(self, knobs: list[Knobs], every: int = 8, wait_threshold_s: float = 1e-3,
                 full_threshold: float = 0.5):
        self.knobs = knobs
        self.every, self.wait_threshold_s, self.full_threshold = every, wait_threshold_s, full_threshold
        self._waits = np.zeros(len(knobs))
        self._steps = 0

    def observe(self, step: int, waits_s: np.ndarray, blocked_fraction: np.ndarray) -> None:
        self._waits += waits_s
        self._steps += 1
        if self._steps < self.every:
            return
        for s, knobs in enumerate(self.knobs):
            if self._waits[s] > self.wait_threshold_s * self._steps:
                knobs.grow(step)
            elif blocked_fraction[s] > self.full_threshold:
                knobs.shrink(step)
        self._waits[:] = 0
        self._steps = 0
