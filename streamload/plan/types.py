"""Plain data passed between the coordinator and the planner. NumPy only, no I/O.

The planner sees every rank's *head window* of every source's buffer, flattened into one
struct-of-arrays (`Candidates`), and returns an `Assignment`: which candidates to take this
step and the (rank, row) each one goes to. Candidates it does not take stay in their buffers,
in order, and are offered again next step with `age + 1`.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class Geometry:
    ranks: int            # R: data-parallel world size
    micro_batches: int    # M: rows per rank per step
    capacity: int         # C: tokens per row
    # P: pipeline stages. A rank's step then takes the 1F1B time of its micro-batches,
    # (sum + (P - 1) * max) / P (`cost.pipeline_time`), and the planner balances rows, not
    # only rank totals. 1: no pipeline, a rank's step is the sum of its rows.
    pipeline_stages: int = 1

    @property
    def pipelined(self) -> bool:
        """The step waits on each rank's costliest micro-batch too (P > 1 and M > 1)."""
        return self.pipeline_stages > 1 and self.micro_batches > 1

    @property
    def work_time(self) -> float:
        """A rank's step time per unit of its work when its M rows cost the same:
        (M + P - 1) / (M * P); 1 without a pipeline."""
        M, P = self.micro_batches, self.pipeline_stages
        return (M + P - 1) / (M * P)

    @property
    def rows(self) -> int:
        return self.ranks * self.micro_batches

    @property
    def step_tokens(self) -> int:
        return self.rows * self.capacity


@dataclass(frozen=True)
class Candidates:
    """Every rank's head window of every source, flattened. All arrays have one entry per item.

    Items are ordered by (source, rank, position): position 0 is the oldest item of that
    rank's buffer for that source. Every length is in 1..capacity (long documents were already
    split, truncated or dropped upstream).
    """
    length: np.ndarray      # int64 tokens
    source: np.ndarray      # int32 source index
    rank: np.ndarray        # int32 rank that holds the item (that fetched it)
    position: np.ndarray    # int32 index in that rank's window of that source
    age: np.ndarray         # int32 steps this item has already been offered and not taken
    extra_cost: np.ndarray  # float64 per-sample cost added by the source's cost hook (often 0)
    num_sources: int
    num_ranks: int
    # bool: a piece of a document longer than C, which the planner may cut to fill a row (the
    # rest stays in its buffer). Whole documents are never cut. None: no item is.
    divisible: np.ndarray | None = None
    # What each item feeds a vision encoder, for the caps per row (`caps.py`): int64 images and
    # patches. None: no item has images (a text job).
    images: np.ndarray | None = None
    patches: np.ndarray | None = None

    def __post_init__(self):
        if self.divisible is None:
            object.__setattr__(self, "divisible", np.zeros(self.length.shape[0], dtype=bool))

    def __len__(self) -> int:
        return int(self.length.shape[0])

    @staticmethod
    def from_windows(windows: list[list[np.ndarray]], ages: list[list[np.ndarray]] | None = None,
                     extra_costs: list[list[np.ndarray]] | None = None,
                     divisible: list[list[np.ndarray]] | None = None,
                     images: list[list[np.ndarray]] | None = None,
                     patches: list[list[np.ndarray]] | None = None) -> "Candidates":
        """Build from windows[rank][source] -> int lengths (ages / extra costs / divisible
        flags / images / patches alike, optional)."""
        num_ranks = len(windows)
        num_sources = len(windows[0]) if windows else 0
        sizes = np.array([[len(w) for w in per_rank] for per_rank in windows],
                         np.int64).reshape(num_ranks, num_sources)
        source, rank, position = window_columns(sizes)

        def field(per_window, dtype, fill=0):
            if per_window is None:
                return np.full(source.shape[0], fill, dtype=dtype)
            return flatten_windows(per_window, dtype)

        c = Candidates(
            flatten_windows(windows, np.int64), source, rank, position,
            field(ages, np.int32), field(extra_costs, np.float64), num_sources, num_ranks,
            field(divisible, bool, False),
            None if images is None else field(images, np.int64),
            None if patches is None else field(patches, np.int64))
        if extra_costs is None:   # zeros: known without the pass `has_extra_cost` makes
            c.__dict__["has_extra_cost"] = False
        # Laid out by `window_columns(sizes)`: its windows are known, as `decode_summaries`
        # knows them (the dry run's candidates then skip the scans for them, as the loader's do).
        return c.known_windows(sizes) if num_ranks and num_sources else c

    @cached_property
    def _source_bounds(self) -> np.ndarray | None:
        """Where each source's items start (num_sources + 1 offsets), when the items come by
        source as windows lay them out; None when they do not (a hand-built set)."""
        s = self.source
        if s.size and not bool((s[1:] >= s[:-1]).all()):
            return None
        return np.searchsorted(s, np.arange(self.num_sources + 1))

    @cached_property
    def float_length(self) -> np.ndarray:
        """`length` as float64, for weighted sums (`np.bincount` casts integer weights to float
        on every call, which costs twice the count itself)."""
        return self.length.astype(np.float64)

    @cached_property
    def arrival_key(self) -> np.ndarray:
        """int64 per item: source · (largest position + 1) + position, its cell in a histogram
        by (source, position), arrival order's unit (`lookahead`, `select.interleaved_head`).
        Worked out once per step, whoever asks first."""
        span = int(self.position.max(initial=-1)) + 1
        key = self.by_source(np.arange(self.num_sources, dtype=np.int64) * span)   # a new array
        key += self.position   # in place: no second array of every item (50 MB at R = 4096)
        return key

    @cached_property
    def arrival_tokens(self) -> np.ndarray:
        """float64 [num_sources · (largest position + 1)]: every candidate's tokens per
        (source, position), by `arrival_key` (read-only: a histogram of a subset is this one
        less that of the rest, sums of whole numbers, so exact). Worked out once per step."""
        span = int(self.position.max(initial=-1)) + 1
        out = np.bincount(self.arrival_key, weights=self.float_length,
                          minlength=self.num_sources * span)
        out.flags.writeable = False
        return out

    def arrival_tokens_less(self, out: np.ndarray) -> np.ndarray:
        """`arrival_tokens` of every candidate but those in `out` (indices): a new array."""
        return self.arrival_tokens - np.bincount(self.arrival_key[out],
                                                 weights=self.float_length[out],
                                                 minlength=self.arrival_tokens.size)

    @cached_property
    def costs(self) -> dict:
        """Every candidate's cost by cost model, once worked out this step
        (`balance.item_costs`): the lookahead's selection works them out for all candidates,
        and the balancer then reads those of the selected ones (read-only arrays)."""
        return {}

    @cached_property
    def has_extra_cost(self) -> bool:
        """Whether any item has a cost of its own (`extra_cost` not all zero). Known without a
        pass where `from_windows` had no extra costs, and kept by `QuotaMixer.quota`'s
        relabelled candidates (the same array)."""
        return bool(self.extra_cost.any())

    def by_source(self, values: np.ndarray) -> np.ndarray:
        """`values[source]` for every item (one value per source): a repeat per source where the
        items come by source, not a gather."""
        bounds = self._source_bounds
        if bounds is None:
            return values[self.source]
        return np.repeat(values, np.diff(bounds))

    def source_tokens(self, mask: np.ndarray | None = None) -> np.ndarray:
        """Tokens per source (float64) of the items in `mask` (bool per item; None: all). Sums of
        whole numbers, so exact: the same as `np.bincount(source, weights=...)`, without its
        cast of every length (a few ms at 10^6 items)."""
        length = self.length if mask is None else np.where(mask, self.length, 0)
        bounds = self._source_bounds
        if bounds is None:
            return np.bincount(self.source, weights=length, minlength=self.num_sources)
        out = np.zeros(self.num_sources)
        nonempty = np.flatnonzero(bounds[1:] > bounds[:-1])
        if nonempty.size:
            out[nonempty] = np.add.reduceat(length, bounds[nonempty])
        return out

    @cached_property
    def window_bounds(self) -> np.ndarray | None:
        """Where each window (source · num_ranks + rank) starts, and the end (num_sources ·
        num_ranks + 1 offsets), when the items come by (source, rank, position) as windows
        lay them out; None when they do not (sources relabelled by length buckets,
        `quota_mixer`, come in any order). Searched per source over its ranks, not over a key
        per item."""
        by_source = self._source_bounds
        if by_source is None:
            return None
        S, R = self.num_sources, self.num_ranks
        bounds = np.empty(S * R + 1, dtype=np.int64)
        queries = np.arange(R)
        for s in range(S):
            first, end = int(by_source[s]), int(by_source[s + 1])
            ranks = self.rank[first:end]
            if not (ranks[1:] >= ranks[:-1]).all():
                return None
            bounds[s * R:(s + 1) * R] = first + np.searchsorted(ranks, queries)
        bounds[S * R] = len(self)
        return bounds

    @cached_property
    def dense_positions(self) -> bool:
        """Whether each window's items sit at positions 0, 1, 2, ... in order, as
        `from_windows` lays them out: the item at (window w, position p) is then at
        `window_bounds[w] + p`, found without a search."""
        bounds = self.window_bounds
        if bounds is None:
            return False
        p = self.position
        starts = bounds[:-1][bounds[:-1] < bounds[1:]]
        if p.size == 0:
            return True
        if p[starts].any():
            return False
        steps = np.diff(p)
        steps[starts[1:] - 1] = 1                      # across the start of a window
        return bool((steps == 1).all())

    def known_windows(self, sizes: np.ndarray) -> "Candidates":
        """These candidates laid out by window with `sizes` [R, S] items each, their source,
        rank and position from `window_columns(sizes)`: `window_bounds` and the source bounds
        are the sizes' cumulative sums and the positions are dense, so nothing searches or
        scans for them. Returns self."""
        bounds = _window_bounds(sizes)
        self.__dict__["window_bounds"] = bounds
        self.__dict__["_source_bounds"] = bounds[::self.num_ranks]
        self.__dict__["dense_positions"] = True
        return self

    def keep_layout(self, other: "Candidates") -> "Candidates":
        """What `other`, the same items by the same sources (relabelled by no length bucket),
        knows of its layout (`known_windows`, or found): the window and source bounds and the
        dense flag hold for these too. Returns self."""
        for name in ("window_bounds", "_source_bounds", "dense_positions"):
            if name in vars(other):
                self.__dict__[name] = vars(other)[name]
        return self

    def windows(self):
        """((source, rank), slice) of every non-empty window, in candidate order (items laid
        out by window)."""
        bounds = self.window_bounds
        if bounds is None:
            key = self.source.astype(np.int64) * self.num_ranks + self.rank
            bounds = np.searchsorted(key, np.arange(self.num_sources * self.num_ranks + 1))
        for k in np.flatnonzero(np.diff(bounds)).tolist():
            yield divmod(k, self.num_ranks), slice(int(bounds[k]), int(bounds[k + 1]))


def window_columns(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each candidate's source, rank and position in its window (int32), from the window
    sizes [R, S], in the candidates' order (`flatten_windows`): repeats over the sizes, a few
    NumPy calls whatever R x S."""
    num_ranks, num_sources = sizes.shape
    ordered = sizes.T.reshape(-1)   # by source, then rank
    bounds = _window_bounds(sizes)
    position = np.arange(int(bounds[-1]), dtype=np.int64)
    position -= np.repeat(bounds[:-1], ordered)
    return (np.repeat(np.arange(num_sources, dtype=np.int32), sizes.sum(axis=0)),
            np.repeat(np.tile(np.arange(num_ranks, dtype=np.int32), num_sources), ordered),
            position.astype(np.int32))


def _window_bounds(sizes: np.ndarray) -> np.ndarray:
    """Where each window (source · R + rank) of window sizes [R, S] starts in the candidates'
    order, and the end: S · R + 1 offsets."""
    ordered = sizes.T.reshape(-1)   # by source, then rank
    bounds = np.zeros(ordered.shape[0] + 1, np.int64)
    np.cumsum(ordered, out=bounds[1:])
    return bounds


def flatten_windows(per_window: list[list[np.ndarray]], dtype) -> np.ndarray:
    """per_window[rank][source] arrays (their first axis runs over the window's items) laid
    out in the candidates' order: by source, then rank, then position. The one place that
    order is made; `Candidates.windows` is its inverse."""
    num_ranks = len(per_window)
    num_sources = len(per_window[0]) if per_window else 0
    parts = [np.asarray(per_window[r][s], dtype=dtype)
             for s in range(num_sources) for r in range(num_ranks)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


@dataclass(frozen=True)
class Assignment:
    """The planner's answer for one step.

    take[i] is an index into Candidates; it goes to row `row[i]` of rank `rank[i]`, with
    `length[i]` of its tokens: all of them, or the first ones of a divisible item the planner
    cut to fill a row (the rest stays in its buffer). Within a row, items are packed in the
    order they appear here. Every (rank, row) sums to at most capacity tokens. `rank_cost` is
    the predicted cost of each rank under the cost model: the sum over its rows (`row_cost`);
    `step_time` is each rank's time under the pipeline model (`cost.pipeline_time`: the sum
    without a pipeline).
    """
    take: np.ndarray        # int64
    rank: np.ndarray        # int32
    row: np.ndarray         # int32
    rank_cost: np.ndarray   # float64 [R]
    length: np.ndarray      # int64: tokens taken of each item
    row_cost: np.ndarray | None = None    # float64 [R, M]: predicted cost of each row
    step_time: np.ndarray | None = None   # float64 [R]: each rank's 1F1B time (P stages)

    def __len__(self) -> int:
        return int(self.take.shape[0])
