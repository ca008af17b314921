"""How far a heavy layer may move a step off its quotas: no further than the mixer's carry
takes back (`lookahead`).

A layer's tokens are its sources' overshoot, and the room it takes is the other sources'
shortfall; the mixer's carry repays both over the next steps (`quota_mixer`). A source's carry
after a step is about its target less what it took (its target is its share of the step plus
the carry it came with), and the carry holds at most `CARRY_CLIP_STEPS` steps' worth: what
passes it is never repaid. Where one layer is a whole step (32k rows, four ranks: four
documents of a row each), a source owed a few tokens gave a step of its documents, layers came
back to back, and the web source (40% of the mix) fell behind past the clip, by up to a step's
worth, never repaid (96 steps: 0.0171 off its weight). So, with `slack` the most tokens a
carry may hold after the step (`MIX_SLACK` steps' worth):

- *Overshoot* (`within_overshoot`): a source offers a layer free heavy items (not forced) of
  at most what it is owed this step plus `slack` tokens, the oldest first; only where a slot
  is a rank's one row (`bounds_overshoot`). With `slack` a step, a layer (at most a step)
  never passes the bound itself: what the rule does is leave the layer fewer and older items
  to choose its level from. That held the mix at 32k DP (R = 2, 4 and 64) and raised the
  efficiency there, but cost 0.002-0.011 of it at 128k (PP = 4 at R = 64, CP = 4), where the
  mix was within 0.006 without it: measured, not derived (docs/benchmarks.md, mix11).
- *Shortfall* (`keeps_mix`): a layer of free items only (none forced) is left out when, with
  it, some source would end the step owed more than `slack`, and more than without it: the
  light take first repays what the layers before left owed. A source whose light items are
  all it can give (it has no heavy ones) and less than it is owed may be owed nothing more:
  at the end of its data, a layer held its last items back step after step, and the epoch's
  steps with every source (over which the mix is judged) ran on with the heavy sources alone.

Forced items never wait (the deferral bound): a layer with forced items is kept whatever it
owes.
"""
from __future__ import annotations

import numpy as np

from .types import Geometry

MIX_SLACK = 1.0   # steps' worth: the most a layer may leave a source owed or overdrawn


def bounds_overshoot(geometry: Geometry) -> bool:
    """Whether the layer's candidates are held to the overshoot bound (`within_overshoot`):
    where a slot is a rank's one row (one micro-batch per rank, so no pipeline either)."""
    return geometry.micro_batches == 1


def within_overshoot(items: np.ndarray, source: np.ndarray, length: np.ndarray,
                     age: np.ndarray, owed: np.ndarray, slack: float,
                     overdrawn: bool = False) -> np.ndarray:
    """Of the heavy `items` (candidate indices, ascending), those within their source's
    overshoot budget, `owed` (tokens, per source; none below 0 unless `overdrawn`: then a
    source already past its quota has that much less) plus `slack`: per source the oldest
    first (then in index order) while their tokens stay within it. Ascending indices."""
    if items.size == 0:
        return items
    src = source[items].astype(np.int64)
    order = np.lexsort((items, -age[items].astype(np.int64), src))
    src, tokens = src[order], length[items[order]].astype(np.float64)
    through = np.cumsum(tokens)
    first = np.searchsorted(src, src, side="left")      # each source's first entry
    within_source = through - (through[first] - tokens[first])
    budget = owed if overdrawn else np.maximum(owed, 0.0)
    keep = within_source <= budget[src] + slack
    return np.sort(items[order[keep]])


def keeps_mix(quota: np.ndarray, used: np.ndarray, taken: np.ndarray,
              taken_without: np.ndarray, light: np.ndarray, slack: float) -> bool:
    """Whether a layer leaves no source owed more than it may be and more than without it:
    `quota` less `taken` (tokens per source, with the layer) against `quota` less
    `taken_without` (without it); `used`, the tokens taken before (the forced ones). A source
    may be owed `slack` tokens, or none when its light items (`light`, tokens per source; 0
    for a source with heavy items to give) are all it can give and it is owed them all: a
    source at the end of its data (the epoch's last steps), whose last items a layer would
    hold back step after step."""
    short = (light > 0) & (quota - used >= light)
    limit = np.maximum(np.where(short, 0.0, slack), quota - taken_without)
    return not (quota - taken > limit + 0.5).any()
