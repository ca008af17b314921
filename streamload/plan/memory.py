"""How one rank's `memory_budget` is split between its sources' head windows, buffers and bytes
in flight, step by step. Pure NumPy: the windows decide what the planner sees, so every rank (and
the dry run) must size them alike from the job's history alone, never from fetch timing."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import LoaderConfig

TOKEN_BYTES = 4           # buffered tokens: at most int32 (byte tokens are uint8): an upper bound


def source_token_bytes(sources) -> np.ndarray:
    """Each source's bytes per buffered token: TOKEN_BYTES, plus for an image source the
    encoded image bytes its items hold per token (`Images.encoded_bytes_per_token`)."""
    return np.array([TOKEN_BYTES + (s.images.encoded_bytes_per_token
                                    if getattr(s, "images", None) is not None else 0)
                     for s in sources], dtype=np.int64)


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

    A buffered token costs `token_bytes[s]` of the budget: TOKEN_BYTES, and for an image source
    also the encoded images its items hold per token (`source_token_bytes`).
    """

    def __init__(self, config: LoaderConfig, max_shares: np.ndarray, names: list[str], ranks: int,
                 token_bytes=None):
        self.config, self.names, self.ranks = config, list(names), ranks
        self.steps = _window_steps(config)
        shares = np.asarray(max_shares, dtype=np.float64)
        shares = shares / shares.sum()
        S = len(shares)
        self.token_bytes = np.full(S, TOKEN_BYTES, np.int64) if token_bytes is None \
            else np.asarray(token_bytes, np.int64)
        windows = self._windows(shares, np.full(S, ranks), np.ones(S, dtype=bool))
        capacities = self._capacities(windows)
        budget = config.memory_budget
        if budget is None:   # 32 MiB, or the least that gives every source its buffer and 2 ranges
            budget = max([DEFAULT_MEMORY_BUDGET] + [
                int(np.ceil((cap * tb + RANGES_PER_SOURCE * config.chunk_bytes)
                            / (0.5 / S + 0.5 * share)))
                for cap, share, tb in zip(capacities, shares, self.token_bytes.tolist())])
        self.budget = int(budget)
        # The start-up split (each source's largest share, every rank holding data) must fit:
        # a budget too small for the geometry fails when the Loader is built.
        for name, share, capacity, tb in zip(names, shares, capacities,
                                             self.token_bytes.tolist()):
            source_bytes = self.budget * (0.5 / S + 0.5 * share)
            if source_bytes - capacity * tb < config.chunk_bytes:
                need = capacity * tb + config.chunk_bytes
                raise ConfigError(
                    f"memory_budget: {self.budget} bytes leaves source {name!r} "
                    f"{int(source_bytes)} bytes, less than it needs for its buffer plus one "
                    f"fetched range ({need} bytes); raise memory_budget or lower chunk_bytes, "
                    f"micro_batch_tokens or window_factor"
                    + (f" (its buffered tokens count {tb} bytes each with the images they "
                       f"hold: Images.encoded_bytes_per_token)" if tb > TOKEN_BYTES else ""))

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

    def budgets(self, shares: np.ndarray, holders: np.ndarray, held: np.ndarray,
                reads=None) -> list[SourceBudget]:
        """This rank's buffers for the next step. `shares[s]`: the mix's share of s now (0 once
        it has no data); `holders[s]`: ranks that still hold data of s; `held[s]`: this rank
        is one of them; `reads[s]` (None: all): this rank reads s at all. A source it does not
        read gets nothing (no buffer, no window, nothing in flight); its readers' windows are
        deeper by R / holders, so they offer the planner the whole job's share."""
        shares = np.asarray(shares, dtype=np.float64)
        held = np.asarray(held, dtype=bool)
        reads = np.ones(held.shape, dtype=bool) if reads is None else np.asarray(reads, bool)
        C, chunk = self.config.micro_batch_tokens, self.config.chunk_bytes
        windows = np.where(reads, self._windows(shares, np.asarray(holders), held), 0)
        capacities = np.where(reads, self._capacities(windows), 0)
        room = self.budget - chunk * max(int(held.sum()), 1)   # a range in flight per source
        floor = np.where(reads, self._capacities(np.full(windows.shape, C)), 0)
        tb = self.token_bytes
        want = float((capacities * tb).sum())
        if want > room:   # shrink every window above one row in proportion
            spare = float(((capacities - floor) * tb).sum())
            scale = max(room - float((floor * tb).sum()), 0.0) / max(spare, 1.0)
            windows = np.where(reads, C + np.floor((windows - C) * min(scale, 1.0))
                               .astype(np.int64), 0)
            capacities = np.where(reads, self._capacities(windows), 0)
        left = max(self.budget - int((capacities * tb).sum()), 0)
        weight = np.where(held, shares, 0.0)
        split = np.where(held, 0.5 / max(int(held.sum()), 1), 0.0) + \
            (0.5 * weight / weight.sum() if weight.sum() > 0 else 0.0)
        inflight = np.maximum((left * split).astype(np.int64), np.where(held, chunk, 0))
        return [SourceBudget(c, w, i) for c, w, i in zip(capacities.tolist(), windows.tolist(),
                                                         inflight.tolist())]

    def initial(self, max_shares: np.ndarray) -> list[SourceBudget]:
        """The start-up split: every rank holds data, each source at its largest share."""
        shares = np.asarray(max_shares, dtype=np.float64)
        S = shares.size
        return self.budgets(shares / shares.sum(), np.full(S, self.ranks), np.ones(S, dtype=bool))
