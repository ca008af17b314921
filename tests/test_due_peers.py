"""Due peers (`lookahead.DUE_PEERS`): under pipeline stages at a few ranks, a forced step with
slots left without a heavy item takes heavy items due within RIDE_AHEAD steps of sources owed
nothing, within their overdraft budget (`layer_mix.within_overshoot(overdrawn=True)`)."""
import numpy as np
import pytest

from streamload.plan import lookahead
from streamload.plan.cost import CostModel
from streamload.plan.layer_mix import within_overshoot
from streamload.plan.lookahead import _due_peers, select_lookahead
from streamload.plan.types import Candidates, Geometry

pytestmark = pytest.mark.core

C = 1024
COST = CostModel(a=1 / 1024, b=1.0)


def _heavy_taken(R: int, monkeypatch, due_peers=(4, 8), slack=None) -> tuple[list, int]:
    """One step at PP = 4, M = 4: source 0 (owed a step) holds short documents and, at rank 0's
    head, a forced 900-token document (age 16); source 1 (owed nothing) a due 800-token one
    (age 14) at each rank's head. Returns the heavy lengths taken and the forced count."""
    monkeypatch.setattr(lookahead, "DUE_PEERS", due_peers)
    if slack is not None:
        monkeypatch.setattr(lookahead, "DUE_SLACK", slack)
    g = Geometry(R, 4, C, pipeline_stages=4)
    windows, ages = [], []
    for r in range(R):
        head = [900] if r == 0 else []
        windows.append([np.array(head + [64] * 64, np.int64), np.array([800, 64, 64], np.int64)])
        ages.append([np.array([16] * len(head) + [0] * 64, np.int64), np.array([14, 0, 0], np.int64)])
    c = Candidates.from_windows(windows, ages)
    selected, forced = select_lookahead(c, np.array([float(g.step_tokens), 0.0]), g, COST,
                                        window=8, force_age=16)
    return sorted(int(n) for n in c.length[selected] if n > 64), int(forced.sum())


def test_a_forced_step_takes_due_items_of_a_source_owed_nothing(monkeypatch):
    # Without the rule the forced document is the step's only heavy one (15 light rows).
    assert _heavy_taken(4, monkeypatch, due_peers=(0, 0)) == ([900], 1)
    # With it, the four due documents join it (3,200 tokens within a quarter step, 4,096).
    assert _heavy_taken(4, monkeypatch) == ([800, 800, 800, 800, 900], 1)
    # Within a tenth of a step (1,638 tokens) the source gives two.
    assert _heavy_taken(4, monkeypatch, slack=0.1) == ([800, 800, 900], 1)


def test_due_peers_only_within_their_ranks(monkeypatch):
    assert _heavy_taken(2, monkeypatch) == ([900], 1)          # R = 2: below DUE_PEERS
    assert _heavy_taken(2, monkeypatch, due_peers=(2, 8)) == ([800, 800, 900], 1)


def test_due_peers_picks_due_items_of_sources_owed_nothing_oldest_first():
    heavy = np.arange(7)
    forced = np.array([True, False, False, False, False, False, False])
    source = np.array([1, 1, 1, 1, 0, 1, 1])
    length = np.full(7, 100)
    age = np.array([16, 14, 15, 13, 15, 14, 15])
    owed = np.array([50.0, -100.0])      # source 0 owed tokens: its items are free already
    # Source 1: due (age >= 14) and not forced: 1, 2, 5, 6; overdraft budget 300 - 100 = 200.
    assert _due_peers(heavy, forced, source, length, age, owed, 16, lone=8,
                      slack=300).tolist() == [2, 6]
    assert _due_peers(heavy, forced, source, length, age, owed, 16, lone=1,
                      slack=300).tolist() == [2]
    assert _due_peers(heavy, forced, source, length, age, np.array([50.0, 0.0]), 16,
                      lone=8, slack=400).tolist() == [1, 2, 5, 6]


def test_within_overshoot_counts_an_overdraft_when_asked():
    source = np.array([0, 0, 0, 0, 1, 1])
    length = np.array([100, 100, 100, 100, 300, 300])
    age = np.array([3, 9, 9, 1, 0, 0])
    items = np.arange(6)
    owed = np.array([-100.0, 600.0])
    assert within_overshoot(items, source, length, age, owed, 300).tolist() == [0, 1, 2, 4, 5]
    assert within_overshoot(items, source, length, age, owed, 300,
                            overdrawn=True).tolist() == [1, 2, 4, 5]
