"""A heavy layer moves a step off its quotas no further than the mixer's carry takes back
(`plan/layer_mix.py`, issue 20: 32k rows at four ranks, where one layer is a whole step)."""
from __future__ import annotations

import numpy as np
import pytest

from streamload.plan import lookahead
from streamload.plan.cost import CostModel
from streamload.plan.layer_mix import bounds_overshoot, keeps_mix, within_overshoot
from streamload.plan.lookahead import select_lookahead
from streamload.plan.types import Candidates, Geometry

pytestmark = pytest.mark.core

R, C, W = 4, 1024, 4
GEOMETRY = Geometry(R, 1, C)            # data parallel: a slot is a rank's row of C tokens
COST = CostModel(a=1 / 1024, b=1.0)     # a piece of C costs twice a row of short documents
T = GEOMETRY.step_tokens


def _step(web_owed: float, web_items: int = 64):
    """One step at four ranks: `web` (source 0) holds short documents (`web_items` of 64 tokens
    per rank), `books` (source 1) a piece of C at the head of every rank's window, `code`
    (source 2) short documents; none due. `books` is owed a fifth of a step, `code` a tenth.
    Returns the tokens taken per source."""
    windows = [[np.full(web_items, 64), np.array([C]), np.full(64, 64)] for _ in range(R)]
    ages = [[np.zeros(w.size, np.int64) for w in row] for row in windows]
    c = Candidates.from_windows(windows, ages)
    targets = np.array([web_owed, 0.2 * T, 0.1 * T])
    selected, forced = select_lookahead(c, targets, GEOMETRY, COST, window=W, force_age=2 * W)
    assert not forced.any()
    return np.bincount(c.source[selected], weights=c.length[selected], minlength=3)


def test_a_layer_waits_while_another_source_is_owed_more_than_the_carry_takes_back(monkeypatch):
    """`books` is owed a fifth of a step, and its four pieces would fill the step: a layer of
    them leaves `web` owed all of its 1.2 steps, past the carry's step (the mixer clips it there:
    never repaid). The layer waits and `web` takes the step; owed 0.6 of a step, it goes."""
    before = _step(web_owed=1.2 * T)
    assert before[1] == 0 and before[0] >= 0.9 * T
    assert _step(web_owed=0.6 * T)[1] == T           # within the slack: the whole step a layer
    monkeypatch.setattr(lookahead, "MIX_SLACK", None)   # the rule before: any source owed a token
    assert _step(web_owed=1.2 * T)[1] == T


def test_a_layer_leaves_the_last_items_of_a_source_to_it(monkeypatch):
    """`web` holds less than it is owed (the end of its data): a layer that would hold its last
    items back waits, however little they are; with more than it is owed, the layer goes."""
    taken = _step(web_owed=0.5 * T, web_items=1)
    assert taken[0] == R * 64 and taken[1] == 0
    assert _step(web_owed=0.5 * T, web_items=16)[1] == T
    monkeypatch.setattr(lookahead, "MIX_SLACK", None)
    assert _step(web_owed=0.5 * T, web_items=1)[0] == 0


def test_a_source_gives_heavy_items_within_what_it_is_owed_plus_the_slack():
    # Two sources; items 0-3 of source 0 (ages 3, 9, 9, 1), items 4-5 of source 1.
    source = np.array([0, 0, 0, 0, 1, 1])
    length = np.array([100, 100, 100, 100, 300, 300])
    age = np.array([3, 9, 9, 1, 0, 0])
    items = np.arange(6)
    kept = within_overshoot(items, source, length, age, owed=np.array([50.0, 0.0]), slack=300)
    assert kept.tolist() == [0, 1, 2, 4]      # the oldest within 350 (source 0) and 300
    kept = within_overshoot(items, source, length, age, owed=np.array([-500.0, 600.0]), slack=0)
    assert kept.tolist() == [4, 5]            # an overdrawn source counts as owed nothing


def test_the_overshoot_bound_holds_where_a_slot_is_a_ranks_one_row():
    assert bounds_overshoot(Geometry(4, 1, C))
    assert not bounds_overshoot(Geometry(4, 2, C))                      # 128k, CP = 4
    assert not bounds_overshoot(Geometry(64, 4, C, pipeline_stages=4))  # 128k, PP = 4


def test_keeps_mix_judges_each_source_against_the_step_without_the_layer():
    quota = np.array([300.0, 100.0])
    used = np.zeros(2)
    light = np.array([1000.0, 1000.0])
    # Source 0 owed 300 with the layer, 0 without: past a slack of 200.
    assert not keeps_mix(quota, used, np.array([0.0, 400.0]), quota, light, slack=200)
    assert keeps_mix(quota, used, np.array([100.0, 300.0]), quota, light, slack=200)
    # Owed as much without the layer (it has nothing more to give): the layer is not the cause.
    assert keeps_mix(quota, used, np.array([0.0, 400.0]), np.array([0.0, 100.0]),
                     np.array([0.0, 1000.0]), slack=200)
    # A source short of light items (50 against 300 owed) may be owed none of them.
    assert not keeps_mix(quota, used, np.array([0.0, 400.0]), np.array([50.0, 350.0]),
                         np.array([50.0, 1000.0]), slack=200)
    assert keeps_mix(quota, used, np.array([0.0, 400.0]), np.array([50.0, 350.0]),
                     np.array([500.0, 1000.0]), slack=400)
