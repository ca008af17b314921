"""Mixing benchmark: how far the realized mix drifts from the target, over windows of K steps.

Two methods, on the same simulated loader (no processes):
  quota   streamload's QuotaMixer: per-step targets with carried deficits, `select` in arrival
          order, then a capacity check: first fit into the step's R*M rows of C tokens, in
          selection order; what does not fit stays queued (as with the runtime's planners).
  random  the baseline of HF `interleave_datasets` / LitData's CombinedStreamingDataset: each
          sample's source is drawn independently, with per-sample probabilities chosen so that
          the *expected* token shares are the targets (p_s / mean_length_s, the best case for
          random draws), until the step's tokens are reached; then the same capacity check.

The simulated coordinator keeps a FIFO window per (rank, source) about two steps deep (as the
runtime does), topped up from seeded lognormal length streams (documents longer than C split
into C-token pieces), and ages what a plan leaves.

Scenarios (R = 8 ranks, M = 4 rows, C = 8192 tokens: 262,144 tokens a step):
  constant      web 45%, code 25%, books 15%, chat 15% by tokens.
  curriculum    linear schedule by steps: web 60 -> 30%, code 20 -> 30%, books 10 -> 30% over the
                first half, then flat; the target is the schedule at each step.
  anneal        stages by tokens consumed (interpolate="step"): three stages.
  long_context  constant weights, plus a quota: at least 30% of tokens from items >= 4096 tokens
                (any source; the data holds about 35%, most of it in books, whose share stays
                15%: in a few steps the windows of the others hold too few long items, and the
                quota is met over windows of 10 steps). Reports the quota's worst window.
  long_books    a long-context stage: web 30%, code 20%, books 40%, chat 10%, and at least 30% of
                every step's tokens from books items >= 4096 tokens.
  samples       by="samples" (weights are shares of samples).
  exhaustion    books holds only ~150 steps' worth of data and runs out (renormalize); the
                deviation is measured against the renormalized targets, over windows that
                cross the moment it runs out.

Metric: for every window of K consecutive steps (K = 1, 10, 100; sliding), the realized share of
each source (tokens, or samples for `samples`) against the window's target share (the per-step
targets weighted by each step's realized total); max_abs_dev is the largest |difference| over
sources and windows. For the quota method, `bound` is 2 * max|carry| / (smallest window total),
the guarantee the carried deficits give (docs/mixing.md); `within_bound` checks it.

Usage: python benchmarks/mixing.py [--steps N] [--seed S] [--quick]
The table goes to stderr; the last line of stdout is {"results": [...]}.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from streamload.plan.quota_mixer import QuotaMixer  # noqa: E402
from _windows import BODY, SourceSpec, StreamWindows  # noqa: E402
from streamload.pieces import cut_documents  # noqa: E402
from streamload.plan.mix_spec import LengthQuota, MixPoint, Mixture  # noqa: E402
from streamload.plan.select import arrival_order, select  # noqa: E402
from streamload.plan.types import Candidates, Geometry  # noqa: E402

GEOMETRY = Geometry(ranks=8, micro_batches=4, capacity=8192)
WINDOWS = (1, 10, 100)



class LengthStream:
    """Deterministic stream of item lengths for one source (documents split at C)."""

    def __init__(self, spec: SourceSpec, capacity: int, seed: int, index: int):
        self.spec, self.capacity = spec, capacity
        self.rng = np.random.default_rng([seed, index])
        self.left = spec.total_tokens

    def draw(self, n: int) -> np.ndarray:
        docs = np.maximum(np.rint(self.rng.lognormal(np.log(self.spec.median), self.spec.sigma, n)),
                          8).astype(np.int64)
        return cut_documents(docs, self.capacity, "split").lengths

    def take(self, tokens: float) -> np.ndarray:
        """The next items, at least `tokens` of them (one item over), until the source ends."""
        if self.left <= 0:
            return np.zeros(0, dtype=np.int64)
        out, have = [], 0
        while have < min(tokens, self.left):
            part = self.draw(64)
            out.append(part)
            have += int(part.sum())
        lengths = np.concatenate(out)
        n = int(np.searchsorted(np.cumsum(lengths), min(tokens, self.left), side="left")) + 1
        lengths = lengths[:n]
        self.left -= float(lengths.sum())
        return lengths


class Coordinator(StreamWindows):
    """Per-(rank, source) FIFO windows (see _windows.py) for the mixing scenarios."""

    def __init__(self, specs, shares: np.ndarray, seed: int, depth_steps: float = 2.0):
        self.specs = specs
        g = GEOMETRY
        super().__init__(g, [LengthStream(s, g.capacity, seed, i) for i, s in enumerate(specs)],
                         depth_steps * shares * g.step_tokens / g.ranks + g.capacity)


def mean_lengths(specs, seed: int) -> np.ndarray:
    """Mean item length per source, from a large sample (what a random sampler would be tuned
    with to hit token shares in expectation)."""
    return np.array([LengthStream(s, GEOMETRY.capacity, seed + 99, i).draw(200_000).mean()
                     for i, s in enumerate(specs)])


def random_selection(c: Candidates, shares: np.ndarray, means: np.ndarray, by_tokens: bool,
                     rng: np.random.Generator) -> np.ndarray:
    """Independent draws: each next sample's source ~ per-sample probabilities, FIFO within the
    source, until the step's tokens are reached (one item over, like select)."""
    S = c.num_sources
    order = arrival_order(c)
    bounds = np.searchsorted(c.source[order], np.arange(S + 1))
    sizes = np.diff(bounds)
    probs = np.where(sizes > 0, shares / means if by_tokens else shares, 0.0)
    mix_mean = float((probs / probs.sum() * means).sum())
    n = int(3 * GEOMETRY.step_tokens / mix_mean) + 64
    drawn = rng.choice(S, size=n, p=probs / probs.sum())
    # The k-th draw of source s takes the k-th item of its queue (if the window has one).
    kth = np.zeros(n, dtype=np.int64)
    for s in range(S):
        hit = drawn == s
        kth[hit] = np.arange(int(hit.sum()))
    ok = kth < sizes[drawn]
    items = order[bounds[drawn[ok]] + kth[ok]]
    before = np.cumsum(c.length[items]) - c.length[items]
    return items[before < GEOMETRY.step_tokens].astype(np.int64)


def first_fit(lengths: np.ndarray) -> np.ndarray:
    """The capacity check: items in the given order go to the first of the step's R*M rows
    with room (C tokens each); returns a mask of the items that fit (the rest stay queued)."""
    C = GEOMETRY.capacity
    room = [C] * GEOMETRY.rows
    fits = np.zeros(lengths.size, dtype=bool)
    first_open = 0
    for i, length in enumerate(lengths.tolist()):
        for r in range(first_open, len(room)):
            if room[r] >= length:
                room[r] -= length
                fits[i] = True
                break
        while first_open < len(room) and room[first_open] < 8:   # full for every item
            first_open += 1
    return fits


def windowed_dev(realized: np.ndarray, targets: np.ndarray, K: int,
                 mask: np.ndarray | None = None) -> tuple[float, float]:
    """realized [T, S] units per step, targets [T, S] share per step -> (max |dev|, min window
    total) over all sliding windows of K steps."""
    totals = realized.sum(axis=1)
    cum_r = np.vstack([np.zeros(realized.shape[1]), np.cumsum(realized, axis=0)])
    cum_t = np.vstack([np.zeros(targets.shape[1]), np.cumsum(targets * totals[:, None], axis=0)])
    cum_n = np.concatenate([[0.0], np.cumsum(totals)])
    n = cum_n[K:] - cum_n[:-K]
    share = (cum_r[K:] - cum_r[:-K]) / n[:, None]
    target = (cum_t[K:] - cum_t[:-K]) / n[:, None]
    dev = np.abs(share - target)
    if mask is not None:
        dev = dev[:, mask]
    return float(dev.max()), float(n.min())


def run_scenario(name: str, specs, mixture: Mixture, steps: int, seed: int) -> list[dict]:
    names = [s.name for s in specs]
    weights = [s.weight for s in specs]
    by_tokens = mixture.by == "tokens"
    means = mean_lengths(specs, seed)
    results = []
    for method in ("quota", "random"):
        mixer = QuotaMixer(mixture, names, weights, capacity=GEOMETRY.capacity)
        coord = Coordinator(specs, mixer.max_shares(), seed)
        rng = np.random.default_rng([seed, 7])
        realized, shares, max_carry, quota_share = [], [], 0.0, []
        ran_out = None
        started = time.perf_counter()
        for step in range(steps):
            c = coord.candidates()
            if len(c) == 0:
                break
            q = mixer.quota(c, GEOMETRY.step_tokens, step)
            if ran_out is None and not q.active.all():
                ran_out = step
            if method == "quota":
                selected = select(q.candidates, q.targets, counts=q.counts)
            else:
                selected = random_selection(c, q.shares, means, by_tokens, rng)
            take = selected[first_fit(c.length[selected])]
            units = mixer.update(q, take)       # random: only to advance the schedule
            max_carry = max(max_carry, float(np.abs(mixer.carry).max()))
            realized.append(units)
            shares.append(q.shares)
            if mixture.quotas:
                quota = mixture.quotas[0]
                hit = (c.length[take] >= quota.min_length) & (
                    True if quota.source is None else c.source[take] == names.index(quota.source))
                u = c.length[take] if by_tokens else np.ones(take.size)
                quota_share.append(float(u[hit].sum()))
            coord.commit(take)
        elapsed = time.perf_counter() - started
        realized, shares = np.array(realized), np.array(shares)
        fill = float(realized.sum() / (len(realized) * GEOMETRY.step_tokens)) if by_tokens else None
        for K in WINDOWS:
            dev, n_min = windowed_dev(realized, shares, K)
            row = {"scenario": name, "method": method, "window": K, "max_abs_dev": dev,
                   "steps": len(realized), "sec": round(elapsed, 2)}
            if fill is not None:
                row["fill"] = round(fill, 4)
            if ran_out is not None:
                row["ran_out_at_step"] = ran_out
            if method == "quota":
                row["max_carry"] = max_carry
                row["bound"] = 2 * max_carry / n_min
                row["within_bound"] = bool(dev <= row["bound"] + 1e-12)
            if quota_share:
                qs = np.array(quota_share)
                totals = realized.sum(axis=1)
                cq = np.concatenate([[0.0], np.cumsum(qs)])
                cn = np.concatenate([[0.0], np.cumsum(totals)])
                frac = (cq[K:] - cq[:-K]) / (cn[K:] - cn[:-K])
                row["quota_fraction"] = mixture.quotas[0].fraction
                row["quota_min_share"] = float(frac.min())
                row["quota_mean_share"] = float(qs.sum() / totals.sum())
            results.append(row)
    return results


def scenarios(steps: int):
    constant = Mixture()
    names = [s.name for s in BODY]
    curriculum = Mixture(schedule=[
        MixPoint(at=0, weights={"web": 0.6, "code": 0.2, "books": 0.1, "chat": 0.1}),
        MixPoint(at=steps // 2, weights={"web": 0.3, "code": 0.3, "books": 0.3, "chat": 0.1})])
    stage = steps * GEOMETRY.step_tokens / 3
    anneal = Mixture(schedule_unit="tokens", interpolate="step", schedule=[
        MixPoint(at=0, weights={"web": 0.5, "code": 0.2, "books": 0.2, "chat": 0.1}),
        MixPoint(at=stage, weights={"web": 0.3, "code": 0.4, "books": 0.2, "chat": 0.1}),
        MixPoint(at=2 * stage, weights={"web": 0.1, "code": 0.3, "books": 0.3, "chat": 0.3})])
    long_context = Mixture(quotas=[LengthQuota(min_length=4096, fraction=0.3)])
    long_books = Mixture(weights={"web": 0.3, "code": 0.2, "books": 0.4, "chat": 0.1},
                         quotas=[LengthQuota(source="books", min_length=4096, fraction=0.3)])
    samples = Mixture(by="samples", weights=dict(zip(names, (0.4, 0.2, 0.1, 0.3))))
    short_books = tuple(SourceSpec(s.name, s.weight, s.median, s.sigma,
                                   total_tokens=150 * 0.15 * GEOMETRY.step_tokens)
                        if s.name == "books" else s for s in BODY)
    return [("constant", BODY, constant), ("curriculum", BODY, curriculum), ("anneal", BODY, anneal),
            ("long_context", BODY, long_context), ("long_books", BODY, long_books),
            ("samples", BODY, samples),
            ("exhaustion", short_books, constant)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="200 steps (windows up to 100)")
    args = parser.parse_args(argv)
    steps = 200 if args.quick else args.steps
    results = []
    started = time.perf_counter()
    for name, specs, mixture in scenarios(steps):
        results += run_scenario(name, specs, mixture, steps, args.seed)
    header = f"{'scenario':<13} {'method':<7} {'K':>4} {'max_abs_dev':>12} {'bound':>10}  quota min share"
    print(header, file=sys.stderr)
    for r in results:
        bound = f"{r['bound']:.5f}" if "bound" in r else "-"
        extra = (f"  {r['quota_min_share']:.4f} (floor {r['quota_fraction']})"
                 if "quota_min_share" in r else "")
        extra += f"  (ran out at step {r['ran_out_at_step']})" if "ran_out_at_step" in r else ""
        print(f"{r['scenario']:<13} {r['method']:<7} {r['window']:>4} {r['max_abs_dev']:>12.5f} "
              f"{bound:>10}{extra}", file=sys.stderr)
    print(f"total {time.perf_counter() - started:.1f} s", file=sys.stderr)
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
