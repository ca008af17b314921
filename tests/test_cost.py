"""The cost model (pure NumPy) and the calibration that measures it (torch)."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from streamload.errors import ConfigError
from streamload.plan.cost import CostModel, SampleCostHook

pytestmark = pytest.mark.core


# ------------------------------------------------------------------------------ CostModel
def test_transformer_coefficients_causal():
    m = CostModel.transformer(n_params=1_000_000, n_layers=4, d_model=256)
    assert m.b == 6 * 1_000_000
    assert m.a == 6 * 4 * 256
    assert m.document_masking is True
    assert m.crossover_length == pytest.approx(m.b / m.a)


def test_transformer_bidirectional_doubles_attention():
    causal = CostModel.transformer(1e6, 4, 256, causal=True)
    full = CostModel.transformer(1e6, 4, 256, causal=False, document_masking=False)
    assert full.a == 2 * causal.a
    assert full.b == causal.b
    assert full.document_masking is False


@pytest.mark.parametrize("bad", [dict(n_params=0, n_layers=1, d_model=8),
                                 dict(n_params=10, n_layers=0, d_model=8),
                                 dict(n_params=10, n_layers=1, d_model=-1)])
def test_transformer_rejects_bad_dims(bad):
    with pytest.raises(ConfigError):
        CostModel.transformer(**bad)


def test_rejects_negative_or_nan():
    with pytest.raises(ConfigError):
        CostModel(a=-1.0)
    with pytest.raises(ConfigError):
        CostModel(b=float("nan"))


def test_doc_cost():
    m = CostModel(a=2.0, b=3.0)
    assert m.doc_cost([0, 1, 10]).tolist() == [0.0, 5.0, 230.0]


def test_row_costs_document_masking_hand_computed():
    m = CostModel(a=1.0, b=10.0)
    # row 0: docs 2 and 3; row 1: doc 4; row 2: empty
    lengths, rows = [2, 4, 3], [0, 1, 0]
    got = m.row_costs(lengths, rows, 3)
    # (4 + 20) + (9 + 30) = 63; 16 + 40 = 56; 0
    assert got.tolist() == [63.0, 56.0, 0.0]


def test_row_costs_plain_causal_hand_computed():
    m = CostModel(a=1.0, b=10.0, document_masking=False)
    got = m.row_costs([2, 4, 3], [0, 1, 0], 3)
    # row 0 has 5 tokens: 25 + 50 = 75; row 1: 16 + 40 = 56
    assert got.tolist() == [75.0, 56.0, 0.0]


def test_plain_causal_never_cheaper_than_masked():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 500, 200)
    rows = rng.integers(0, 16, 200)
    masked = CostModel(a=0.01, b=1.0).row_costs(lengths, rows, 16)
    plain = CostModel(a=0.01, b=1.0, document_masking=False).row_costs(lengths, rows, 16)
    assert np.all(plain >= masked - 1e-9)
    assert masked.sum() == pytest.approx(CostModel(a=0.01, b=1.0).doc_cost(lengths).sum())


def test_extra_cost_hook_adds_per_sample_cost_both_modes():
    # A vision-encoder-like hook: a fixed cost per image; here every sample longer than 100
    # tokens "has an image".
    hook: SampleCostHook = lambda lengths: np.where(lengths > 100, 1000.0, 0.0)
    lengths = np.array([50, 200, 300, 10])
    extra = CostModel.extra_cost(hook, lengths)
    assert extra.tolist() == [0.0, 1000.0, 1000.0, 0.0]
    rows = [0, 0, 1, 1]
    for masking in (True, False):
        m = CostModel(a=0.5, b=2.0, document_masking=masking)
        base = m.row_costs(lengths, rows, 2)
        with_hook = m.row_costs(lengths, rows, 2, extra_cost=extra)
        assert (with_hook - base).tolist() == [1000.0, 1000.0]


def test_extra_cost_without_hook_and_scalar_hook():
    assert CostModel.extra_cost(None, [1, 2, 3]).tolist() == [0.0, 0.0, 0.0]
    assert CostModel.extra_cost(lambda L: 7.0, [1, 2]).tolist() == [7.0, 7.0]
    with pytest.raises(ConfigError):
        CostModel.extra_cost(lambda L: -np.ones(len(L)), [1, 2])


def test_save_load_round_trip(tmp_path):
    m = CostModel(a=1.25e-8, b=4.5e-5, document_masking=False)
    path = tmp_path / "cost.json"
    m.save(path)
    assert CostModel.load(path) == m
    assert CostModel(**json.loads(path.read_text())) == m


def test_load_ignores_extra_keys_and_names_bad_files(tmp_path):
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({"device": "cpu", "a": 1e-8, "b": 2e-5, "c": 0.1, "r2": 0.99}))
    assert CostModel.load(path) == CostModel(a=1e-8, b=2e-5)
    bad = tmp_path / "bad.json"
    bad.write_text('{"b": 1}')
    with pytest.raises(ConfigError, match="bad.json"):
        CostModel.load(bad)
    with pytest.raises(ConfigError, match="missing.json"):
        CostModel.load(tmp_path / "missing.json")


def test_from_fit_clips_tiny_negatives():
    m = CostModel.from_fit(a=-1e-20, b=3.0, c=0.5, r2=0.9)
    assert m.a == 0.0 and m.b == 3.0


# ------------------------------------------------------------------------------ fitting
def _rows():
    from streamload.commands.calibrate import calibration_rows
    return calibration_rows([4096, 2048, 1024], 64)


def test_calibration_rows_cover_equal_totals_with_different_mixes():
    rows = _rows()
    totals = sorted({sum(r) for r in rows})
    assert totals == [1024, 2048, 4096]
    for T in totals:
        same = [r for r in rows if sum(r) == T]
        assert len({sum(L * L for L in r) for r in same}) == len(same) >= 5


@pytest.mark.parametrize("constant", [True, False])
def test_fit_recovers_exact_coefficients(constant):
    from streamload.commands.calibrate import fit_rows
    a, b, c = 2e-8, 4e-5, (3e-3 if constant else 0.0)
    rows = _rows()
    times = [a * sum(L * L for L in r) + b * sum(r) + c for r in rows]
    fit = fit_rows(rows, times, constant=constant)
    assert fit.a == pytest.approx(a, rel=1e-9)
    assert fit.b == pytest.approx(b, rel=1e-9)
    assert fit.c == pytest.approx(c, rel=1e-9, abs=1e-15)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.max_rel_residual < 1e-9
    assert fit.cost_model() == CostModel(a=fit.a, b=fit.b)


def test_fit_with_noise_and_nonnegativity():
    from streamload.commands.calibrate import fit_cost
    rng = np.random.default_rng(1)
    rows = _rows()
    sq = np.array([sum(L * L for L in r) for r in rows], float)
    n = np.array([sum(r) for r in rows], float)
    times = (2e-8 * sq + 4e-5 * n + 1e-3) * rng.uniform(0.97, 1.03, len(rows))
    fit = fit_cost(sq, n, times)
    assert fit.a == pytest.approx(2e-8, rel=0.15)
    assert fit.b == pytest.approx(4e-5, rel=0.15)
    assert fit.max_rel_residual < 0.06
    # Times that *fall* with sum L^2 would need a < 0: the fit clamps it to 0 instead.
    decreasing = 1e-4 * n - 1e-9 * sq
    fit = fit_cost(sq, n, np.maximum(decreasing, 1e-6))
    assert fit.a == 0.0 and fit.b > 0


def test_fit_rejects_bad_input():
    from streamload.commands.calibrate import fit_cost
    with pytest.raises(ValueError):
        fit_cost([1.0], [1.0], [0.0])
    with pytest.raises(ValueError):
        fit_cost([], [], [])


# ------------------------------------------------------------------------------ torch parts
def test_doc_attention_matches_block_diagonal_mask():
    torch = pytest.importorskip("torch")
    from streamload.commands.calibrate import doc_attention, document_mask
    torch.manual_seed(0)
    F = torch.nn.functional
    for lengths, max_calls in [([7, 7, 7], 32), ([5, 9, 9, 3, 5, 1], 32), ([5, 9, 9, 3, 5, 1], 1),
                               ([16], 32)]:
        T = sum(lengths)
        q, k, v = (torch.randn(T, 2, 8, requires_grad=True) for _ in range(3))
        got = doc_attention(q, k, v, lengths, max_calls=max_calls)
        want = F.scaled_dot_product_attention(
            *(x.transpose(0, 1) for x in (q, k, v)), attn_mask=document_mask(lengths)).transpose(0, 1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        (gq,) = torch.autograd.grad(got.square().sum(), q)
        (wq,) = torch.autograd.grad(want.square().sum(), q)
        torch.testing.assert_close(gq, wq, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="sum to"):
        doc_attention(q, k, v, [1, 2])


def test_doc_attention_backward_has_no_per_call_slice():
    """Issue 20: one slice per call made the backward O(calls x row tokens) (each slice's
    gradient is a zeroed tensor of the whole row), so rows of many documents cost far more than
    the cost model said. The row is cut with one split or one gather instead."""
    torch = pytest.importorskip("torch")
    from streamload.commands.calibrate import doc_attention
    for lengths, max_calls in [([5, 9, 9, 3, 5, 1], 32), ([5, 9, 9, 3, 5, 1], 1)]:
        T = sum(lengths)
        q, k, v = (torch.randn(T, 2, 8, requires_grad=True) for _ in range(3))
        out = doc_attention(q, k, v, lengths, max_calls=max_calls)
        names, seen, todo = [], set(), [out.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            names.append(type(node).__name__)
            todo.extend(fn for fn, _ in node.next_functions)
        assert not any(n.startswith("SliceBackward") for n in names), names
        assert sum(n.startswith("IndexSelectBackward") for n in names) <= 4   # q, k, v, out


def test_calibration_rows_distinct_lengths():
    from streamload.commands.calibrate import calibration_rows, spread
    equal = calibration_rows([2048, 1024, 512], 64)
    distinct = calibration_rows([2048, 1024, 512], 64, distinct=True)
    assert len(distinct) == len(equal)
    for e, d in zip(equal, distinct):
        assert sum(d) == sum(e) and len(d) == len(e)
        assert len(set(d)) == len(d)                   # one attention call per document
        assert max(abs(x - y) for x, y in zip(sorted(d), sorted(e))) <= len(e) // 2
    assert spread([7, 7, 7]) == [6, 8, 7]
    assert spread([1, 1]) == [1, 1]                    # cannot spread below 1 token
    assert spread([4, 9, 4]) == [3, 9, 5]


def test_tiny_transformer_cost_model_and_step():
    torch = pytest.importorskip("torch")
    from streamload.commands.calibrate import TinyTransformer
    model = TinyTransformer(vocab=64, d_model=32, heads=2, ffn_mult=4, n_layers=2)
    # per block: qkv 3d^2 + proj d^2 + mlp 8d^2 + 2 layernorms (4d); final ln 2d; head d*V
    d = 32
    expected = 2 * (12 * d * d + 4 * d) + 2 * d + d * 64
    assert model.compute_params() == expected
    m = model.cost_model()
    assert m == CostModel.transformer(expected, 2, d)
    gen = torch.Generator().manual_seed(0)
    row = [10, 6]
    model.step(model.make_input(row, gen), row)
    assert all(p.grad is not None for n, p in model.named_parameters())


def test_calibrate_tiny_run_is_sane(tmp_path, capsys):
    pytest.importorskip("torch")
    from streamload.commands.calibrate import calibrate_main
    out = tmp_path / "cost.json"
    cpu = time.process_time()   # CPU, not wall: another process's load does not count
    import torch
    threads = torch.get_num_threads()
    rc = calibrate_main(["--device", "cpu", "--d-model", "64", "--heads", "2", "--tokens", "512",
                         "256", "--min-doc", "32", "--repeats", "2", "--stat", "min",
                         "--threads", "1", "--clock", "cpu", "--output", str(out)])
    assert torch.get_num_threads() == threads       # restored
    assert rc == 0
    assert time.process_time() - cpu < 30
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert {"device", "a", "b", "c", "r2", "max_rel_residual", "rows"} <= set(result)
    assert result["device"] == "cpu" and result["threads"] == 1 and result["clock"] == "cpu"
    assert len(result["rows"]) == len(_rows_for([512, 256], 32))
    assert result["b"] > 0            # the linear part always shows
    loaded = CostModel.load(out)
    assert loaded.a == pytest.approx(result["a"]) and loaded.b == pytest.approx(result["b"])
    assert any("R^2" in line for line in lines)


def _rows_for(totals, min_doc):
    from streamload.commands.calibrate import calibration_rows
    return calibration_rows(totals, min_doc)


def test_cpu_clock_needs_one_thread():
    torch = pytest.importorskip("torch")
    from streamload.commands.calibrate import Blocks, time_rows
    model = Blocks(32, 2, 4, 1, "cpu", torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(ValueError, match="one torch thread"):
            time_rows(model, [[16]], clock="cpu")
        torch.set_num_threads(1)
        (t,) = time_rows(model, [[16, 16]], repeats=1, clock="cpu")
        assert t > 0
    finally:
        torch.set_num_threads(threads)


def test_cut_savings_add_up_over_successive_cuts():
    """Cutting a piece into parts takes doc_cost(L) − Σ doc_cost(parts) out of the data, however
    the cuts are made: one head at a time (each cut of the rest), as the planner makes them."""
    cost = CostModel(a=1 / 24576, b=1.0)
    rng = np.random.default_rng(0)
    for _ in range(50):
        parts = rng.integers(1, 2000, rng.integers(2, 6))
        total = int(parts.sum())
        rests = total - np.concatenate([[0], np.cumsum(parts)[:-2]])   # length before each cut
        saved = cost.cut_savings(rests, parts[:-1])
        assert saved == pytest.approx(float(cost.doc_cost(total) - cost.doc_cost(parts).sum()))
    assert CostModel(a=1.0, b=1.0, document_masking=False).cut_savings([100], [40]) == 0.0
