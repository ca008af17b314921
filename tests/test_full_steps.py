"""Full steps over a whole epoch (design invariant 8): on a skewed mix with a one-shard source
and a source of long documents that outlives the others, every planner fills its steps, the
epoch takes about total tokens / (R·M·C) steps, and every sample still arrives exactly once.
Fill is deterministic for a seed, so these are not timing tests."""
from __future__ import annotations

import math

import numpy as np
import pytest

import streamload as sl
from corpus import base_ids, write_jsonl_source
from distributed import run_ranks
from streamload.plan.quota_mixer import QuotaMixer, balanced_clip
from streamload.plan.types import Candidates

pytestmark = pytest.mark.timeout(240)

C, M = 1024, 2
PLANNERS = ("naive", "balanced", "lookahead")


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    """Sizes ten times apart, lengths from a few tokens to 16 rows, fewer shards than ranks
    for `chat`, and `books` (long documents) holding far more than its weight consumes."""
    root = tmp_path_factory.mktemp("skewed")
    ids = write_jsonl_source(root, "web", shards=5, per_shard=120, median=300, sigma=1.2, seed=1)
    ids |= write_jsonl_source(root, "code", shards=3, per_shard=60, median=500, sigma=1.3, seed=2)
    ids |= write_jsonl_source(root, "chat", shards=1, per_shard=80, median=60, sigma=1.0, seed=3)
    ids |= write_jsonl_source(root, "books", shards=3, per_shard=30, median=5000, sigma=0.6,
                              seed=4)
    return root, ids


def sources(root):
    return [sl.Source(f"{root}/web", weight=0.4), sl.Source(f"{root}/code", weight=0.3),
            sl.Source(f"{root}/chat", weight=0.15), sl.Source(f"{root}/books", weight=0.15)]


def epoch_job(rank, world, root, planners):
    out = {}
    for planner in planners:
        with sl.Loader(sources(root), micro_batch_tokens=C, micro_batches=M, epochs=1,
                       planner=planner, seed=3) as loader:
            ids, tokens = [], []
            for batch in loader:
                ids += [i for mb in batch.micro_batches for i in mb.sample_ids]
                tokens.append(sum(mb.num_tokens for mb in batch.micro_batches))
            stats = loader.stats()
            out[planner] = (ids, tokens, stats["tokens_per_step"], stats["deferral_max"])
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_every_planner_fills_its_steps_on_gloo_ranks(skewed, world):
    root, expected = skewed
    results = run_ranks(epoch_job, world, str(root), PLANNERS, timeout=200)
    for planner in PLANNERS:
        ids = [i for r in results for i in r[planner][0]]
        assert len(ids) == len(set(ids)) and set(base_ids(ids)) == expected, planner
        per_rank = [r[planner][1] for r in results]
        assert len({len(t) for t in per_rank}) == 1, planner   # the same steps on every rank
        step_tokens = np.sum(per_rank, axis=0)
        total, steps = int(step_tokens.sum()), len(step_tokens)
        ideal = math.ceil(total / (world * M * C))
        fill = total / (steps * world * M * C)
        assert fill >= 0.95, (planner, fill, steps, ideal)
        assert steps <= 1.05 * ideal, (planner, steps, ideal)
        # stats() reports the job's tokens per step, the same on every rank.
        if planner == "lookahead":   # the deferral bound, two windows of W = 8 steps
            assert max(r[planner][3] for r in results) <= 16
        reported = results[0][planner][2]
        assert reported["fill"] == pytest.approx(fill)
        assert reported["p50"] <= world * M * C and reported["p1"] <= reported["p50"]


def test_balanced_takes_no_more_steps_than_naive_at_one_rank(skewed):
    """At R = 1 there is nothing to balance: a slot left empty only lengthens the epoch. Every
    planner fills its steps there, and balanced plans exactly as naive does
    (`Planner.effective_method`), so it takes the same steps with the same samples."""
    root, _ = skewed
    steps, samples = {}, {}
    for planner in PLANNERS:
        with sl.Loader(sources(root), micro_batch_tokens=C, micro_batches=M, epochs=1,
                       planner=planner, seed=3) as loader:
            batches = [[list(mb.sample_ids) for mb in b.micro_batches] for b in loader]
            tokens = loader.stats()["tokens_per_step"]
        steps[planner], samples[planner] = len(batches), batches
        assert tokens["fill"] >= 0.95, (planner, tokens)
    assert steps["balanced"] <= steps["naive"], steps
    assert samples["balanced"] == samples["naive"]


def test_carries_keep_summing_to_zero_while_sources_run_short_and_leave():
    """A carry moves share between sources and never resizes the step: the active sources'
    carries add up to 0 after every update, with windows that run short (so carries saturate
    at the clip) and sources that leave, and every step's targets add up to the step."""
    rng = np.random.default_rng(0)
    names = ["a", "b", "c", "d"]
    mixer = QuotaMixer(sl.Mixture(), names, [0.4, 0.3, 0.2, 0.1])
    T = 8192
    left = np.array([10**9, 10**9, 40 * T, 60 * T], dtype=np.float64)
    for step in range(400):
        windows = []
        for s in range(4):
            # Source b's window holds a tenth of its share for 100 steps: its carry saturates.
            supply = 0.03 * T if (s == 1 and step < 100) else 3 * T
            n = 0 if left[s] <= 0 else int(max(1, min(supply, left[s]) // 512))
            windows.append(rng.integers(1, 1024, n))
        c = Candidates.from_windows([windows])
        quota = mixer.quota(c, T, step)
        if quota.active.any() and c.length.sum() >= 2 * T:
            assert quota.source_targets.sum() >= T - 1e-6, step
        # Take each source's target in arrival order (what select does, without the planner).
        take, at = [], 0
        for s, w in enumerate(windows):
            before = np.cumsum(w) - w
            take += list(at + np.flatnonzero(before < quota.source_targets[s]))
            at += w.size
        units = mixer.update(quota, np.array(take, dtype=np.int64))
        left -= units
        assert abs(mixer.carry[quota.active].sum()) <= 1e-6 * T, (step, mixer.carry)
        assert np.all(np.abs(mixer.carry) <= T * (1 + 1e-9))


def test_balanced_clip_keeps_the_sum_and_the_bound():
    carry = np.array([12000.0, -5000.0, -4000.0, -3000.0, 700.0])
    shares = np.array([0.3, 0.3, 0.2, 0.2, 0.0])
    active = np.array([True, True, True, True, False])
    out = balanced_clip(carry, shares, active, 8192.0)
    assert out[:4].sum() == pytest.approx(carry[:4].sum(), abs=1e-6)
    assert np.all(np.abs(out) <= 8192.0) and out[4] == 0.0
    assert out[0] == pytest.approx(8192.0)


# -- pieces cut to fill rows ---------------------------------------------------------------------
def delivered_parts(batches):
    """(sample id, tokens) of every segment, with the segment's tokens for content checks."""
    out = []
    for batch in batches:
        for mb in batch.micro_batches:
            bounds = mb.cu_seqlens.tolist()
            for sid, lo, hi in zip(mb.sample_ids, bounds, bounds[1:]):
                out.append((sid, mb.tokens[lo:hi].numpy().copy()))
    return out


@pytest.fixture(scope="module")
def long_only(tmp_path_factory):
    """Long documents alone (the tail of an epoch once the short sources ran out): their
    pieces fill rows only when the planner cuts some."""
    root = tmp_path_factory.mktemp("long")
    write_jsonl_source(root, "books", shards=2, per_shard=12, median=3000, sigma=0.5, seed=5)
    write_jsonl_source(root, "notes", shards=1, per_shard=10, median=200, seed=6)
    return root


def long_loader(root, **kw):
    kw.setdefault("planner", "balanced")
    return sl.Loader([sl.Source(f"{root}/books", weight=0.9), sl.Source(f"{root}/notes", weight=0.1)],
                     micro_batch_tokens=C, micro_batches=M, epochs=1, seed=1, **kw)


def test_cut_pieces_fill_the_steps_and_tile_their_documents(long_only):
    """Every planner (naive too: full steps are the loader's guarantee) cuts pieces of long
    documents to fill rows: steps are full, and the parts of every piece (":k", ":k+offset")
    put its tokens back together exactly once."""
    import json
    from streamload.commands.demo.corpus import check_delivery
    for planner in PLANNERS:
        with long_loader(long_only, planner=planner) as loader:
            batches = list(loader)
        parts = delivered_parts(batches)
        assert any("+" in sid for sid, _ in parts), "no piece was cut"
        documents = {}
        for path in sorted((long_only / "books").iterdir()) + sorted((long_only / "notes").iterdir()):
            for r, line in enumerate(path.read_text().splitlines()):
                documents[f"{path.parent.name}/{path.name}/{r}"] = json.loads(line)["text"].encode()
        expected = {}
        for doc, data in documents.items():
            if len(data) <= C:
                expected[doc] = len(data)
            else:
                expected.update({f"{doc}:{k}": min(C, len(data) - k * C)
                                 for k in range(-(-len(data) // C))})
        check = check_delivery([(sid, t.size) for sid, t in parts], expected)
        assert not any(check.values()), check
        # The parts hold the document's bytes, in order.
        rebuilt = {}
        for sid, tokens in sorted(parts, key=lambda p: (p[0].split(":")[0], pieces_order(p[0]))):
            rebuilt.setdefault(sid.split(":")[0], []).append(tokens.astype(np.uint8).tobytes())
        assert {doc: b"".join(chunks) for doc, chunks in rebuilt.items()} == documents
        steps = len(batches)
        total = sum(t.size for _, t in parts)
        assert steps == math.ceil(total / (M * C)), (planner, steps, total)


def pieces_order(sid: str) -> tuple[int, int]:
    suffix = sid.split(":", 1)[1] if ":" in sid else "-1"
    k, _, offset = suffix.partition("+")
    return int(k), int(offset or 0)


def test_resume_is_identical_at_every_stop_with_cut_pieces(long_only):
    from resumecheck import resume_divergence
    with long_loader(long_only) as loader:
        steps = sum(1 for _ in loader)
    total, diverged = resume_divergence(lambda: long_loader(long_only), range(1, steps))
    assert total == steps and not diverged, diverged


def elastic_job(rank, world, root, stop, state):
    import msgspec
    with long_loader(root) as loader:
        if state is not None:
            loader.load_state_dict(state)
        parts = []
        for k, batch in enumerate(loader):
            parts += [(sid, int(n)) for mb in batch.micro_batches
                      for sid, n in zip(mb.sample_ids, np.diff(mb.cu_seqlens.numpy()))]
            if stop is not None and k + 1 >= stop:
                break
        return parts, msgspec.json.decode(loader.state_dict()["streamload"])


def test_elastic_resume_with_cut_pieces_delivers_every_token_once(long_only):
    """Stopped while pieces are cut (their rest pending, with an offset in the state), resumed
    at another world size: every piece is still tiled exactly once."""
    import msgspec
    from streamload.commands.demo.corpus import check_delivery
    first = run_ranks(elastic_job, 2, str(long_only), 5, None)
    state = {"streamload": msgspec.json.encode(first[0][1]).decode()}
    from streamload.state import decode_state
    pending = decode_state(msgspec.json.encode(first[0][1])).ages   # (source, shard, record,
    cut_pending = any(c >= 0 and c & 0xFFFFFFFF for *_, c, _ in pending)   # chunk, age)
    second = elastic_job(0, 1, str(long_only), None, state)
    with long_loader(long_only) as loader:   # one uninterrupted run: what each piece holds
        whole = [(sid, int(n)) for b in loader for mb in b.micro_batches
                 for sid, n in zip(mb.sample_ids, np.diff(mb.cu_seqlens.numpy()))]
    expected = {}
    for sid, n in whole:
        base = sid.partition("+")[0]
        expected[base] = expected.get(base, 0) + n
    parts = [p for r in first for p in r[0]] + second[0]
    check = check_delivery(parts, expected)
    assert not any(check.values()), check
    assert cut_pending or any("+" in sid for sid, _ in parts)


def test_the_dry_run_counts_the_work_the_loader_cut_out(long_only, tmp_path):
    """The dry run's `cut_work` (attention work that cutting pieces took out of the data) adds
    up to what the loader's delivered parts show: a piece of L tokens delivered in parts n_i
    saved a·(L² − Σ n_i²). At R = 1 the dry run predicts the loader's plan exactly."""
    from streamload.commands.dryrun import scan, simulate
    from streamload.configfile import LoaderSpec
    a = 1 / 24576
    kw = dict(micro_batch_tokens=C, micro_batches=M, epochs=1, seed=1, cost_a=a, cost_b=1.0,
              planner="naive")   # the same windows in both (the lookahead's are W steps deep)
    srcs = [sl.Source(f"{long_only}/books", weight=0.9), sl.Source(f"{long_only}/notes", weight=0.1)]
    with sl.Loader(srcs, **kw) as loader:
        batches = list(loader)
        stats, summary = loader.stats(), loader.summary()
    assert f"{stats['pieces_cut']:,} pieces of long documents cut to fill rows" in summary
    pieces = {}
    for sid, tokens in delivered_parts(batches):
        pieces.setdefault(sid.partition("+")[0], []).append(tokens.size)
    delivered = sum(a * (sum(ns) ** 2 - sum(n * n for n in ns)) for ns in pieces.values())
    assert delivered > 0, "no piece was cut"
    assert stats["pieces_cut"] == sum(len(ns) - 1 for ns in pieces.values())   # a cut per part
    assert stats["cut_work"] == pytest.approx(delivered, rel=1e-9)
    spec = LoaderSpec("test", srcs, kw, sl.Mixture())
    reports = simulate(spec, scan(spec), steps=10_000, ranks=1)
    assert len(reports) == len(batches)
    assert sum(r.cut_work for r in reports) == pytest.approx(delivered, rel=1e-9)


def test_the_top_up_never_fills_rows_from_a_source_the_schedule_leaves_out(tmp_path):
    """A source at weight 0 sits the mix out while others have data (docs/mixing.md), and the
    top-up must not leak it into rows with room either: next to a source that restarts (never
    runs out) it is never read; under a schedule it starts at the step its weight does."""
    write_jsonl_source(tmp_path, "web", shards=2, per_shard=50, median=300, sigma=1.2, seed=1)
    write_jsonl_source(tmp_path, "math", shards=1, per_shard=40, median=200, seed=2)
    web, math_ = f"{tmp_path}/web", f"{tmp_path}/math"
    with sl.Loader([sl.Source(web, weight=1.0, on_exhausted="restart"),
                    sl.Source(math_, weight=0.0)], micro_batch_tokens=C, micro_batches=M,
                   seed=1) as loader:
        for step, batch in enumerate(loader):
            if step == 300:
                break
        stats = loader.stats()
    assert stats["sources"]["math"]["delivered_samples"] == 0
    assert stats["tokens_per_step"]["fill"] >= 0.95
    mixture = sl.Mixture(schedule_unit="steps", interpolate="step", schedule=[
        sl.MixPoint(at=0, weights={"web": 1.0, "math": 0.0}),
        sl.MixPoint(at=20, weights={"web": 0.5, "math": 0.5})])
    with sl.Loader([sl.Source(web), sl.Source(math_)], mixture=mixture, micro_batch_tokens=C,
                   micro_batches=M, seed=1, epochs=1) as loader:
        first_math = next(b.step for b in loader
                          for mb in b.micro_batches for i in mb.sample_ids if i.startswith("math/"))
    assert first_math == 20
