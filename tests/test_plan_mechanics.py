"""Mechanics the planner's speed rests on: per-source sums by segment (`Candidates`), window
bounds and arrival keys, the arrival take's own count of what it took, and the
light fill's runs (`balance._runs`) ahead of the waves.

The per-source helpers must give what the weighted counts and gathers they replace give,
whether or not the candidates come by source. The runs must keep every row within its gap,
place each item once, hand back exactly what they did not place, and leave the waves a fill
as good as the waves alone reach.
"""
from __future__ import annotations

import numpy as np
import pytest

from streamload.plan.balance import RUN_ROWS, WAVE_ITEMS, _Bins, _longest_first, _runs, _waves
from streamload.plan.types import Candidates

pytestmark = pytest.mark.core


def _candidates(rng, shuffled: bool) -> Candidates:
    ranks, sources = int(rng.integers(1, 6)), int(rng.integers(1, 5))
    windows = [[rng.integers(1, 5000, int(rng.integers(0, 30)) if rng.random() > 0.2 else 0)
                for _ in range(sources)] for _ in range(ranks)]
    c = Candidates.from_windows(windows)
    if not shuffled or len(c) < 2:
        return c
    p = rng.permutation(len(c))
    return Candidates(c.length[p], c.source[p], c.rank[p], c.position[p], c.age[p],
                      c.extra_cost[p], c.num_sources, c.num_ranks, c.divisible[p])


def _arrival_tokens(c: Candidates, mask: np.ndarray) -> np.ndarray:
    """[S, largest position + 1]: tokens of the items in `mask` per (source, position), counted
    directly (what `Candidates.arrival_tokens` and the lookahead's takes lay out)."""
    span = int(c.position.max()) + 1
    return np.bincount(c.source.astype(np.int64) * span + c.position,
                       weights=np.where(mask, c.length, 0).astype(np.float64),
                       minlength=c.num_sources * span).reshape(c.num_sources, span)


@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("seed", range(20))
def test_per_source_sums_and_values_match_counts_and_gathers(seed, shuffled):
    rng = np.random.default_rng(seed)
    c = _candidates(rng, shuffled)
    S = c.num_sources
    mask = rng.random(len(c)) < 0.6
    expected = np.bincount(c.source, weights=np.where(mask, c.length, 0), minlength=S)
    assert np.array_equal(c.source_tokens(mask), expected)
    assert np.array_equal(c.source_tokens(), np.bincount(c.source, weights=c.length,
                                                         minlength=S))
    values = rng.integers(0, 100, S)
    assert np.array_equal(c.by_source(values), values[c.source])
    assert np.array_equal(c.float_length, c.length.astype(np.float64))


def _bins(rng, rows: int, capacity: int):
    n = rows * 40
    length = rng.integers(1, 400, n).astype(np.int64)
    weight = length * 1.0 + length.astype(np.float64) ** 2 / 49152
    bins = _Bins(rows, 1, capacity, weight, length, np.full(n, -1, np.int64))
    # Rows already part full (heavy items), the gaps a share of what is left.
    bins.fill[:, 0] = rng.integers(0, capacity // 2, rows)
    gaps = ((capacity - bins.fill[:, 0]) * rng.uniform(0.3, 1.0, rows)).astype(np.float64)
    return bins, gaps, _longest_first(np.arange(n), length)


@pytest.mark.parametrize("seed", range(6))
def test_runs_keep_rows_within_their_gaps_and_leave_the_waves_a_full_fill(seed):
    rng = np.random.default_rng(seed)
    rows, capacity = RUN_ROWS + 100, 16384
    bins, gaps, items = _bins(rng, rows, capacity)
    start, gaps0 = bins.fill[:, 0].copy(), gaps.copy()

    left = _runs(bins, items, gaps)
    assert left.size < items.size - rows * WAVE_ITEMS        # the runs placed most items
    placed = np.flatnonzero(bins.bin >= 0)
    # Each item once, exactly the ones not handed back; rows and loads add up.
    assert np.array_equal(np.sort(np.concatenate([placed, left])), np.sort(items))
    added = np.bincount(bins.bin[placed], weights=bins.length[placed], minlength=rows)
    assert np.array_equal(bins.fill[:, 0] - start, added.astype(np.int64))
    assert np.allclose(gaps, gaps0 - added)
    assert (added <= gaps0 + 0.5).all() and (bins.fill <= capacity).all()
    # What is handed back is longest first, as the waves need it.
    assert (np.diff(bins.length[left]) <= 0).all()

    left = _waves(bins, left, gaps)
    assert (bins.fill <= capacity).all() and (gaps >= -0.5).all()
    runs_tokens = int(bins.fill.sum() - start.sum())

    # The same rows filled by the waves alone.
    alone, gaps_alone, items_alone = _bins(np.random.default_rng(seed), rows, capacity)
    _waves(alone, items_alone, gaps_alone)
    waves_tokens = int(alone.fill.sum() - start.sum())
    assert runs_tokens >= 0.995 * waves_tokens


def test_runs_leave_few_rows_and_rank_bins_to_the_waves():
    rng = np.random.default_rng(0)
    bins, gaps, items = _bins(rng, RUN_ROWS // 2, 16384)
    assert np.array_equal(_runs(bins, items, gaps), items)     # few rows: waves only
    many = _Bins(RUN_ROWS, 2, 16384, bins.weight, bins.length, bins.home_bin)
    gaps2 = np.full(RUN_ROWS * 2, 8000.0)
    assert np.array_equal(_runs(many, items, gaps2), items)    # several rows per bin


@pytest.mark.parametrize("seed", range(20))
def test_window_bounds_and_arrival_keys_match_the_per_item_keys(seed):
    """`Candidates.window_bounds` (searched per source) is where each (source, rank) key
    starts, empty windows included; `arrival_key` is source · (largest position + 1) +
    position; `windows()` walks the same segments."""
    rng = np.random.default_rng(seed)
    c = _candidates(rng, shuffled=False)
    S, R = c.num_sources, c.num_ranks
    window = c.source.astype(np.int64) * R + c.rank
    assert np.array_equal(c.window_bounds, np.searchsorted(window, np.arange(S * R + 1)))
    span = int(c.position.max(initial=-1)) + 1
    assert np.array_equal(c.arrival_key, c.source.astype(np.int64) * span + c.position)
    seen = np.zeros(len(c), dtype=int)
    for (s, r), part in c.windows():
        assert (c.source[part] == s).all() and (c.rank[part] == r).all()
        seen[part] += 1
    assert (seen == 1).all()
    assert c.has_extra_cost is False


@pytest.mark.parametrize("seed", range(20))
def test_the_arrival_take_counts_what_it_took_by_source_and_position(seed):
    """`lookahead._take_arrival` takes, per source in arrival order (position, then rank), the
    items of the mask while the source's tokens stay below its quota (a loop over each source's
    items finds the same), and reports the tokens it took per (source, position) from the
    histogram it was given: the same as a histogram of the take (the selection derives the
    pool's and the light items' sums from it), and the tokens it adds to `used` are their sums
    per source."""
    from streamload.plan.lookahead import _take_arrival
    rng = np.random.default_rng(seed)
    c = _candidates(rng, shuffled=False)
    if len(c) == 0:
        return
    mask = rng.random(len(c)) < 0.8
    tokens = _arrival_tokens(c, mask)
    quota = tokens.sum(axis=1) * rng.uniform(0, 1.2, c.num_sources)
    used = np.zeros(c.num_sources)
    take, took = _take_arrival(c, mask, used, quota, tokens)
    assert not (take & ~mask).any()
    assert np.array_equal(took, _arrival_tokens(c, take))
    assert np.array_equal(used, took.sum(axis=1))
    expected = np.zeros(len(c), dtype=bool)
    for s in range(c.num_sources):
        items = np.flatnonzero(mask & (c.source == s))
        items = items[np.lexsort((c.rank[items], c.position[items]))]
        before = 0
        for i in items.tolist():
            if before >= quota[s]:
                break
            expected[i] = True
            before += int(c.length[i])
    assert np.array_equal(take, expected)


@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_light_take_by_window_cuts_matches_the_arrival_take_whatever_the_layout(seed, shuffled):
    """`lookahead._LightTake`: the take worked out per window (a cut position per source, the
    edge items, looked up by window) is `_take_arrival`'s over the light items, with the same
    tokens counted into `used`, and its first light item left per (source, rank) window is a
    loop's over that take. Laid out by window, and in any order (sources relabelled by
    length buckets)."""
    from streamload.plan.lookahead import _LightTake, _take_arrival, step_quotas
    rng = np.random.default_rng(seed)
    c = _candidates(rng, shuffled)
    if len(c) == 0:
        return
    window = c.source.astype(np.int64) * c.num_ranks + c.rank
    assert (c.window_bounds is None) == bool((window[1:] < window[:-1]).any())
    assert c.dense_positions == (c.window_bounds is not None and all(
        np.array_equal(c.position[part], np.arange(part.stop - part.start))
        for _, part in c.windows()))
    # Mostly light, or mostly not (long runs of heavy items for `_LightTake._next_light`).
    light = rng.random(len(c)) < (0.7 if seed % 2 else 0.1)
    tokens = _arrival_tokens(c, light)
    lights = _LightTake(c, light, tokens)
    quota = tokens.sum(axis=1) * rng.uniform(0, 1.2, c.num_sources)
    used = rng.integers(0, 3000, c.num_sources).astype(np.float64)
    room = float(rng.uniform(0, 1.2) * quota.sum())
    got_used = used.copy()
    take = lights(quota, got_used, room)
    # What `_LightTake` asks of `_take_arrival` (its rule before it cut by window).
    remaining = np.maximum(quota - used, 0.0)
    remaining = step_quotas(remaining * (room / max(remaining.sum(), 1e-9)), tokens.sum(axis=1))
    expected_used = used.copy()
    expected, _ = _take_arrival(c, light, expected_used, used + remaining, tokens)
    assert np.array_equal(lights.mask(take), expected)
    assert np.array_equal(got_used, expected_used)
    never = np.iinfo(c.position.dtype).max
    first_left = np.full(c.num_sources * c.num_ranks, never, dtype=c.position.dtype)
    for i in range(len(c)):
        if light[i] and not expected[i]:
            first_left[window[i]] = min(first_left[window[i]], c.position[i])
    assert np.array_equal(take[2], first_left)


def test_dense_positions_only_where_each_window_counts_from_zero():
    """`Candidates.dense_positions`: true as `from_windows` lays windows out (empty ones
    included), false where a window's positions skip, repeat or do not start at 0."""
    c = Candidates.from_windows([[np.array([5, 6, 7]), np.zeros(0, np.int64)],
                                 [np.array([1]), np.array([2, 3])]])
    assert c.dense_positions
    for position in ([0, 1, 3, 0, 0, 1], [0, 1, 1, 0, 0, 1], [1, 2, 3, 0, 0, 1],
                     [0, 1, 2, 0, 1, 2]):
        other = Candidates(c.length, c.source, c.rank, np.array(position, np.int32), c.age,
                           c.extra_cost, c.num_sources, c.num_ranks)
        assert not other.dense_positions


@pytest.mark.parametrize("seed", range(40))
def test_first_feasible_level_by_blocks_is_the_whole_matrix_rule(seed):
    """`lookahead._first_feasible` tries the levels a block at a time, heaviest first: the
    same level as summing the whole (items x levels) matrix at once (the rule it replaces),
    float for float, whatever the number of levels (blocks keep two columns at least)."""
    from streamload.plan.lookahead import ALIKE, _first_feasible
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3000))
    length = rng.integers(1, 32768, n).astype(np.int64)
    x = rng.random(n) * length.astype(np.float64) ** 2 * 10 ** rng.uniform(-6, -3)
    levels = np.unique(x)[::-1]
    levels = levels[np.unique(np.linspace(0, levels.size - 1, int(rng.integers(1, 65)))
                              .astype(np.int64))]
    slot_tokens = int(rng.choice([4096, 32768, 131072]))
    xc, lc = x[:, None], length[:, None]
    fits = (xc <= levels[None, :] * (1 + 1e-9)) & \
        (xc * slot_tokens >= ALIKE * levels[None, :] * lc)
    sums = np.where(fits, xc, 0.0).sum(axis=0)
    # Slots that some level, anywhere in the list, can just give (or none, now and then).
    slots = max(int(sums[int(rng.integers(0, levels.size))] / levels[0] * rng.uniform(0.5, 8)), 1)
    feasible = sums >= slots * levels
    expected = float(levels[int(np.argmax(feasible))]) if feasible.any() else None
    assert _first_feasible(levels, xc, lc, slots, slot_tokens) == expected


@pytest.mark.parametrize("seed", range(20))
def test_from_windows_knows_the_windows_a_scan_finds(seed):
    """`Candidates.from_windows` knows its layout (`known_windows`, as the loader's decoded
    summaries do): the window and source bounds and the dense flag are what searches and
    scans of the same columns find."""
    c = _candidates(np.random.default_rng(seed), shuffled=False)
    assert {"window_bounds", "_source_bounds", "dense_positions"} <= set(vars(c))
    searched = Candidates(c.length, c.source, c.rank, c.position, c.age, c.extra_cost,
                          c.num_sources, c.num_ranks)
    assert np.array_equal(c.window_bounds, searched.window_bounds)
    assert np.array_equal(c._source_bounds, searched._source_bounds)
    assert c.dense_positions and searched.dense_positions


@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("seed", range(20))
def test_arrival_tokens_less_some_items_is_the_histogram_of_the_rest(seed, shuffled):
    """`Candidates.arrival_tokens_less(out)`: every candidate's tokens per (source, position)
    less those of `out` are exactly the histogram of the others (the lookahead's unforced
    items, the top-up's members), whatever the layout."""
    rng = np.random.default_rng(seed)
    c = _candidates(rng, shuffled)
    if len(c) == 0:
        return
    out = rng.random(len(c)) < (0.3 if seed % 2 else 0.9)
    assert np.array_equal(c.arrival_tokens_less(np.flatnonzero(out)),
                          _arrival_tokens(c, ~out).ravel())
    assert np.array_equal(c.arrival_tokens,
                          _arrival_tokens(c, np.ones(len(c), dtype=bool)).ravel())
    assert not c.arrival_tokens.flags.writeable


@pytest.mark.parametrize("extra", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_costs_of_the_selected_are_the_floats_worked_out_for_them(seed, extra):
    """The balancer reads the selected items' costs from those the lookahead worked out for
    every candidate (`Candidates.costs`): bit for bit what it works out for them alone, with
    a cost hook's extra cost or without; another cost model is not mixed up with it."""
    from streamload.plan.balance import item_costs
    from streamload.plan.cost import CostModel
    rng = np.random.default_rng(seed)
    c = _candidates(rng, shuffled=False)
    extra_cost = rng.uniform(0, 5e3, len(c)) * (rng.random(len(c)) < 0.5) if extra \
        else np.zeros(len(c))

    def fresh():
        return Candidates(c.length, c.source, c.rank, c.position, c.age, extra_cost,
                          c.num_sources, c.num_ranks)

    cost, other = CostModel(1 / 49152, 1.0, True), CostModel(1 / 4096, 1.0, True)
    idx = np.flatnonzero(rng.random(len(c)) < 0.5)
    alone = item_costs(fresh(), idx, cost)
    known = fresh()
    item_costs(known, None, cost)
    assert set(known.costs) == {cost}
    assert np.array_equal(item_costs(known, idx, cost).view(np.int64), alone.view(np.int64))
    assert np.array_equal(item_costs(known, idx, other).view(np.int64),
                          item_costs(fresh(), idx, other).view(np.int64))


@pytest.mark.parametrize("share", [0.01, 0.2, 0.5, 1.0])
@pytest.mark.parametrize("seed", range(15))
def test_window_fronts_found_per_window_are_the_running_sums_rule(seed, share, monkeypatch):
    """`balance._fronts_within` (a search per window over running tokens) marks the same
    items as `_window_fronts`' running sums per window, empty windows and ties with the
    bound (a window of equal lengths) included."""
    from streamload.plan import balance
    monkeypatch.setattr(balance, "FRONT_SHARE", share)
    rng = np.random.default_rng(seed)
    c = _candidates(rng, shuffled=False)
    if seed == 0:   # equal lengths: a front ends exactly at the bound
        c = Candidates.from_windows([[np.full(10, 100), np.zeros(0, np.int64)],
                                     [np.full(5, 7), np.array([3, 1, 1, 5])]])
    selected = np.flatnonzero(rng.random(len(c)) < 0.7)
    length = c.length[selected].astype(np.int64)
    window = c.source[selected].astype(np.int64) * c.num_ranks + c.rank[selected]
    expected = balance._window_fronts(length, window, None)
    got = balance._window_fronts(length, window, None, balance._selected_windows(c, selected))
    assert np.array_equal(got, expected)


@pytest.mark.parametrize("seed", range(10))
def test_within_is_isin_for_ascending_indices(seed):
    """`lookahead._within(items, among)`: np.isin for `among` ascending, items in any order,
    `among` empty or not."""
    from streamload.plan.lookahead import _within
    rng = np.random.default_rng(seed)
    among = np.flatnonzero(rng.random(200) < (0.0 if seed == 0 else 0.3))
    items = rng.permutation(rng.integers(0, 220, int(rng.integers(0, 50))))
    assert np.array_equal(_within(items, among), np.isin(items, among))


@pytest.mark.parametrize("shape", [(0,), (7,), (3 * (1 << 16) + 5,), (2, 70_001)])
def test_split_cost_by_blocks_is_the_elementwise_formula(shape):
    """`CostModel.split_cost` works a block at a time: bit for bit (a·L)·L + b·L and b·L for
    every item, across block edges, for any shape and for a strided view."""
    from streamload.plan.cost import CostModel
    rng = np.random.default_rng(len(shape) + shape[-1])
    lengths = rng.integers(1, 131_073, shape)
    cost = CostModel(1 / 49152, 1.0, True)
    for given in (lengths, lengths[..., ::2]):
        f = given.astype(np.float64)
        total, linear = cost.split_cost(given)
        want_linear = cost.b * f
        want = cost.a * f
        want *= f
        want += want_linear
        assert total.shape == linear.shape == given.shape
        assert np.array_equal(linear.view(np.int64), want_linear.view(np.int64))
        assert np.array_equal(total.view(np.int64), want.view(np.int64))
    total, linear = cost.split_cost(np.int64(4096))
    assert total == cost.a * 4096.0 * 4096.0 + cost.b * 4096.0 and linear == cost.b * 4096.0


def test_has_extra_cost_known_without_a_pass_only_when_there_are_none():
    """`from_windows` with no extra costs knows there are none (no pass over the zeros), and
    the quota's relabelled candidates keep it; with extra costs given, the scan decides."""
    from streamload import Mixture
    from streamload.plan.quota_mixer import QuotaMixer
    windows = [[np.array([5, 7]), np.array([3])], [np.array([4]), np.array([9, 2])]]
    none = Candidates.from_windows(windows)
    assert vars(none)["has_extra_cost"] is False and not none.has_extra_cost
    zeros = Candidates.from_windows(windows, extra_costs=[[np.zeros(len(w)) for w in r]
                                                          for r in windows])
    assert "has_extra_cost" not in vars(zeros) and not zeros.has_extra_cost
    some = Candidates.from_windows(windows, extra_costs=[[np.arange(len(w), dtype=float)
                                                          for w in r] for r in windows])
    assert some.has_extra_cost
    def mixer():
        return QuotaMixer(Mixture(), ["a", "b"], [0.5, 0.5])
    assert vars(mixer().quota(none, 64).candidates)["has_extra_cost"] is False
    assert mixer().quota(some, 64).candidates.has_extra_cost
