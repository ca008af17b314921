"""Under 1F1B, the rank that waits on one heavy row gives up light items (`pipeline_trim`)."""
import numpy as np

from streamload.plan.caps import RowCaps
from streamload.plan.cost import CostModel, pipeline_time
from streamload.plan.fill import FULL, epoch_cost, step_overhead_cost
from streamload.plan.pipeline_trim import applies as trim_applies, trim_slowest
from streamload.plan.types import Candidates, Geometry

R, M, P, C = 4, 4, 4, 1000
COST = CostModel(a=1 / 100, b=1.0)


def _step(heavy: int):
    """A full step of 10-token items, but rank 0's row 0: one `heavy`-token item (the first
    candidate, forced) and 10-token items up to C. Returns (candidates, take, rank, row)."""
    light_in_heavy_row = (C - heavy) // 10
    lengths = [heavy] + [10] * light_in_heavy_row + [10] * (100 * (R * M - 1))
    cells = [0] * (1 + light_in_heavy_row) + list(np.repeat(np.arange(1, R * M), 100))
    c = Candidates.from_windows([[np.array(lengths, dtype=np.int64)]])
    take = np.arange(len(c))
    cell = np.array(cells)
    return c, take, (cell // M).astype(np.int32), (cell % M).astype(np.int32)


def _times(c, take, rank, row):
    rows = COST.row_costs(c.length[take], rank.astype(np.int64) * M + row, R * M)
    return pipeline_time(rows.reshape(R, M), P)


def test_the_rank_of_a_lone_heavy_row_gives_up_light_items_while_the_epoch_gains():
    """A 900-token item alone among 10-token ones: its rank pays its row P times over (a
    document no other item of the step is like: 128k PP=4 R=512, steps at 0.66-0.80). The
    trim takes light items off that rank only, its heavy row's first (each saves its whole cost,
    on the other rows a P-th), keeps the forced item and the step FULL, and lowers the step's
    time and what the step costs the epoch (`fill.epoch_cost`)."""
    geometry = Geometry(R, M, C, pipeline_stages=P)
    overhead = step_overhead_cost(0.05, geometry, COST)
    c, take, rank, row = _step(900)
    length = c.length[take]
    stay, rank2, row2 = trim_slowest(c, take, rank, row, length, geometry, COST, overhead,
                        np.array([0]), force_age=16)
    assert (rank2 == rank).all() and (row2 == row).all()   # every row full: none can move
    assert stay[0]                                       # the forced item stays
    gone = np.flatnonzero(~stay)
    assert gone.size > 10
    assert (rank[gone] == 0).all()
    assert set(range(1, 11)) <= set(gone.tolist())       # its heavy row's light items first
    assert length[stay].sum() >= FULL * geometry.step_tokens
    before, after = _times(c, take, rank, row), _times(c, take[stay], rank[stay], row[stay])
    assert after.max() < before.max()
    work = COST.doc_cost(length.astype(float))
    assert epoch_cost(after, work[stay].sum(), int(length[stay].sum()), geometry, overhead) < \
        epoch_cost(before, work.sum(), int(length.sum()), geometry, overhead)


def test_a_forced_item_or_an_even_step_is_left_as_it_is():
    """Nothing goes when the heavy row's items must stay and the others save too little, nor
    when no rank stands out of the step's even time (a step of light items only)."""
    geometry = Geometry(R, M, C, pipeline_stages=P)
    overhead = step_overhead_cost(0.05, geometry, COST)
    c, take, rank, row = _step(10)                       # every row: 100 items of 10 tokens
    assert trim_slowest(c, take, rank, row, c.length[take], geometry, COST, overhead,
                        np.array([0]), force_age=16)[0].all()
    c, take, rank, row = _step(900)                      # every item forced
    assert trim_slowest(c, take, rank, row, c.length[take], geometry, COST, overhead,
                        take, force_age=16)[0].all()


def test_light_items_move_to_rows_with_room_before_any_leaves_the_step():
    """With room in other ranks' rows (a step at 0.99, the rest spread), the heavy rank's light
    items move there first: the step keeps its items and its time falls."""
    geometry = Geometry(R, M, C, pipeline_stages=P)
    overhead = step_overhead_cost(0.05, geometry, COST)
    c, take, rank, row = _step(900)
    # Take 20 light items off the last rank's last row: 200 tokens of room there.
    drop = np.flatnonzero((rank == R - 1) & (row == M - 1))[:20]
    keep = np.setdiff1d(np.arange(take.size), drop)
    c, take, rank, row = c, take[keep], rank[keep], row[keep]
    length = c.length[take]
    stay, rank2, row2 = trim_slowest(c, take, rank, row, length, geometry, COST, overhead,
                                     np.array([0]), force_age=16)
    moved = np.flatnonzero((rank2 != rank) | (row2 != row))
    assert stay.all() and moved.size > 0                 # within the budget, nothing leaves
    assert (rank[moved] == 0).all() and (rank2[moved] == R - 1).all()
    before, after = _times(c, take, rank, row), _times(c, take, rank2, row2)
    assert after.max() < before.max()
    assert np.bincount(rank2.astype(np.int64) * M + row2, weights=length).max() <= C


def test_an_image_step_with_caps_per_row_is_not_trimmed():
    """The trim fills rows by tokens: on an image step with caps per row it does not run (a
    row could pass its cap of images), as `pipeline_moves` does not."""
    c, _, _, _ = _step(900)
    geometry = Geometry(R, M, C, pipeline_stages=P)
    with_images = Candidates.from_windows([[c.length]], images=[[np.ones(len(c), np.int64)]])
    assert trim_applies(c, geometry, COST, RowCaps(images=85))        # text: caps hold nothing
    assert trim_applies(with_images, geometry, COST)                  # no caps
    assert not trim_applies(with_images, geometry, COST, RowCaps(images=85))
    assert not trim_applies(c, Geometry(R, M, C), COST)               # no pipeline
