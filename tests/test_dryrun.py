"""`streamload plan CONFIG.toml`: the dry run of a configuration's plan (streamload/commands/dryrun)."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from corpus import write_jsonl_source, write_token_source

from streamload.commands.cli import main
from streamload.configfile import load_config
from streamload.commands.dryrun import scan, scan_lengths, simulate, summarize
from streamload.plan.windows import Block, ItemQueue
from streamload.pipeline.buffer import ItemBlock, SourceBuffer

MIX_TOLERANCE = 0.02   # realized share over the 20-step run vs the weights (tokens)

LOADER = """
[loader]
micro_batch_tokens = 1024
micro_batches = 2
planner = "balanced"
seed = 3
"""
SOURCES = """
[[source]]
uri = "web/"

[[source]]
uri = "code/"
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    # 8 shards each: every one of 4 ranks gets two shards of each source (the loader's deal).
    write_jsonl_source(root, "web", 8, 100, median=200, seed=1)
    write_token_source(root, "code", 8, 100, median=300, seed=2)
    return root


def write(root, name: str, text: str):
    path = root / name
    path.write_text(text)
    return str(path)


def plan_json(capsys, path, *extra) -> dict:
    rc = main(["plan", path, "--steps", "20", "--ranks", "4", "--json", *extra])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out.strip().splitlines()[-1])


def test_plan_realized_mix_and_balance(corpus, capsys):
    path = write(corpus, "constant.toml",
                 LOADER + "[mixture]\nweights = { web = 0.7, code = 0.3 }\n" + SOURCES)
    result = plan_json(capsys, path)
    summary, steps = result["summary"], result["steps"]
    assert summary["steps"] == len(steps) == 20
    assert [s["name"] for s in summary["scans"]] == ["web", "code"]
    assert summary["scans"][0]["method"] == "scan" and summary["scans"][1]["method"] == "index"
    for name, weight in (("web", 0.7), ("code", 0.3)):
        assert summary["sources"][name]["share"] == pytest.approx(weight, abs=MIX_TOLERANCE)
        assert summary["sources"][name]["target"] == pytest.approx(weight)
    assert summary["mix_max_abs_dev"] <= MIX_TOLERANCE
    assert all(step["imbalance"] >= 1.0 - 1e-12 for step in steps)
    assert 1.0 <= summary["imbalance_mean"] <= summary["imbalance_max"]
    for step in steps:
        assert len(step["rank_cost"]) == len(step["rank_tokens"]) == 4
        assert max(step["rank_cost"]) / np.mean(step["rank_cost"]) == \
            pytest.approx(step["imbalance"], rel=1e-5)
        assert sum(step["tokens"].values()) == sum(step["rank_tokens"])
        assert sum(step["rank_tokens"]) <= 4 * 2 * 1024


def test_plan_text_output_ends_with_json_summary(corpus, capsys):
    path = write(corpus, "text.toml", LOADER + SOURCES)
    assert main(["plan", path, "--steps", "5", "--ranks", "4"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.split()[:1] == ["4"] for line in lines)          # step 4's table row
    assert any(line.startswith("imbalance: mean") for line in lines)
    summary = json.loads(lines[-1])["summary"]
    assert summary["steps"] == 5 and "steps" not in json.loads(lines[-1])


def test_schedule_changes_the_mix_at_its_step(corpus, capsys):
    path = write(corpus, "schedule.toml", LOADER + """
[mixture]
interpolate = "step"

[[mixture.schedule]]
at = 0
weights = { web = 0.8, code = 0.2 }

[[mixture.schedule]]
at = 10
weights = { web = 0.2, code = 0.8 }
""" + SOURCES)
    steps = plan_json(capsys, path)["steps"]
    web = np.array([s["share"]["web"] for s in steps])
    target = np.array([s["target_share"]["web"] for s in steps])
    np.testing.assert_allclose(target[:10], 0.8)
    np.testing.assert_allclose(target[10:], 0.2)
    assert web[:10].mean() == pytest.approx(0.8, abs=0.05)
    assert web[10:].mean() == pytest.approx(0.2, abs=0.05)
    assert web[9] > 0.5 > web[10]   # the switch lands at the scheduled step, not later


@pytest.mark.parametrize("table, key", [
    ("[mixture]\nweights = { web = -1.0, code = 1.0 }\n", "mixture.weights.web"),
    ("[mixture]\nweights = { web = 1.0, cod = 1.0 }\n", "mixture.weights.cod"),
    ("[cost]\na = -1.0\n", "cost.a"),
])
def test_bad_config_exits_2_naming_the_key(corpus, capsys, table, key):
    path = write(corpus, "bad.toml", LOADER + table + SOURCES)
    assert main(["plan", path, "--steps", "20", "--ranks", "4", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and "Traceback" not in captured.err


def test_bad_arguments_exit_2(corpus, capsys):
    path = write(corpus, "args.toml", LOADER + SOURCES)
    assert main(["plan", path, "--ranks", "0"]) == 2
    assert "--ranks" in capsys.readouterr().err


def test_max_docs_samples_and_repeats(corpus, capsys):
    path = write(corpus, "sample.toml", LOADER + SOURCES)
    spec = load_config(path)
    scans = scan(spec, max_docs=30)
    assert [s.documents for s in scans] == [30, 30] and not any(s.complete for s in scans)
    reports = simulate(spec, scans, steps=20, ranks=4)   # 30 documents repeat as needed
    assert len(reports) == 20
    assert all(r.fill > 0.9 for r in reports)
    summary = plan_json(capsys, path, "--max-docs", "30")["summary"]
    assert all(s["sampled"] for s in summary["scans"])


def test_epochs_end_the_run(corpus):
    path = write(corpus, "epochs.toml", LOADER + "epochs = 1\n" + SOURCES)
    spec = load_config(path)
    lengths = scan_lengths(spec)
    total = sum(int(x.sum()) for x in lengths)
    reports = simulate(spec, lengths, steps=10_000, ranks=4)
    assert 0 < len(reports) < 10_000
    assert sum(int(r.tokens.sum()) for r in reports) == total   # every item exactly once
    assert summarize(spec, reports)["epochs"] == 1


def test_shards_dealt_like_the_loader(corpus):
    spec = load_config(write(corpus, "deal.toml", LOADER + SOURCES))
    scans = scan(spec)
    assert scans[1].shard_items.size == 8 and scans[1].complete
    # Without epochs, a second epoch follows the first and deals the shards again.
    reports = simulate(spec, scans, steps=120, ranks=4)
    assert len(reports) == 120 and reports[-1].epoch >= 1


def test_window_matches_source_buffer():
    """The simulated head window behaves like SourceBuffer's: same prefix, ages and `done`."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 300, 400).astype(np.int64)
    W = 700

    async def run():
        buffer = SourceBuffer(10 ** 9, W)
        # blocks of uneven sizes, as ranges arrive
        cuts = [0, 1, 50, 51, 200, 333, 400]
        await buffer.put(ItemBlock.of_arrays(0, [np.zeros(n, np.int32) for n in lengths[a:b]],
                                             np.arange(a, b)) for a, b in zip(cuts, cuts[1:]))
        await buffer.end_epoch(0)
        blocks = iter([Block.of(lengths[:150]), Block.of(lengths[150:], np.stack(
            [np.zeros(250, np.int64), np.arange(150, 400), np.full(250, -1)], axis=1))])
        window = ItemQueue(lambda _tokens: next(blocks, None))
        for _ in range(200):
            items = buffer.window()
            done = items.done
            sim, ages, ids, sim_done = window.window(W)
            np.testing.assert_array_equal(sim, items.lengths)
            np.testing.assert_array_equal(ages, items.ages)
            np.testing.assert_array_equal(ids, items.ids)
            assert sim_done == done
            n = items.lengths.shape[0]
            if not n:
                break
            positions = np.flatnonzero(rng.random(n) < 0.5)
            buffer.take(positions, n)
            window.commit(positions, sim, ages, ids)
        assert done

    asyncio.run(run())


def test_simulate_takes_plain_arrays():
    from streamload.configfile import parse_config
    spec = parse_config(LOADER + "[mixture]\nweights = { a = 3.0, b = 1.0 }\n"
                        + '[[source]]\nuri = "/x/a/"\n[[source]]\nuri = "/x/b/"\n')
    rng = np.random.default_rng(0)
    lengths = [rng.integers(1, 1025, 5000), rng.integers(1, 200, 20000)]
    reports = simulate(spec, lengths, steps=30, ranks=8)
    summary = summarize(spec, reports)
    assert summary["sources"]["a"]["share"] == pytest.approx(0.75, abs=MIX_TOLERANCE)


@pytest.mark.parametrize("ranks", [1, 3])
def test_simulated_restart_source_keeps_its_weight_until_the_finite_one_ends(ranks):
    from streamload.configfile import parse_config
    spec = parse_config(LOADER + "epochs = 1\n[mixture]\nweights = { a = 1.0, b = 1.0 }\n"
                        + '[[source]]\nuri = "/x/a/"\n'
                        + '[[source]]\nuri = "/x/b/"\non_exhausted = "restart"\n')
    rng = np.random.default_rng(0)
    lengths = [rng.integers(1, 1025, 3000), rng.integers(1, 1025, 2)]   # b: two items
    reports = simulate(spec, lengths, steps=10_000, ranks=ranks)
    assert len(reports) < 10_000, "the finite source must end the epoch"
    tokens = np.sum([r.tokens for r in reports], axis=0)
    assert tokens[0] == lengths[0].sum()            # every item of a, once
    assert tokens[1] > 100 * lengths[1].sum()       # b, pass after pass
    assert summarize(spec, reports)["sources"]["b"]["share"] == pytest.approx(0.5, abs=MIX_TOLERANCE)


def words(text: str) -> list[str]:
    """A tokenizer for the configuration below: one token per word."""
    return text.split()


def test_length_scan_uses_the_configured_tokenizer(corpus):
    plain = load_config(write(corpus, "bytes.toml", LOADER + SOURCES))
    tokenized = load_config(write(corpus, "words.toml", LOADER.replace(
        "[loader]", '[loader]\ntokenizer = "test_dryrun:words"') + SOURCES))
    by_bytes, by_words = scan(plain)[0], scan(tokenized)[0]
    assert by_words.documents == by_bytes.documents == 800
    assert 0 < by_words.tokens < by_bytes.tokens / 3          # words, not UTF-8 bytes
    assert scan(tokenized)[1].tokens == scan(plain)[1].tokens  # token shards: the index


def test_missing_source_exits_1_naming_it(tmp_path, capsys):
    path = write(tmp_path, "missing.toml", LOADER + SOURCES)
    assert main(["plan", path, "--steps", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("source 'web'" in err[0] or "source 'code'" in err[0])


def test_plan_planner_flag_overrides_the_file_and_the_tail_is_reported_apart(corpus, capsys):
    """`--planner` overrides the file's; over a whole epoch at R=8, each planner holds the mix
    on the steps where every source had data (the deviation there), and the epoch's tail, where
    a source's last items come late, is reported apart."""
    path = write(corpus, "epoch.toml", LOADER.replace("seed = 3", "seed = 3\nepochs = 1")
                 + "[mixture]\nweights = { web = 0.7, code = 0.3 }\n" + SOURCES)
    summaries = {}
    for planner in ("naive", "balanced"):
        rc = main(["plan", path, "--steps", "1000", "--ranks", "8", "--json",
                   "--planner", planner])
        out = capsys.readouterr().out
        assert rc == 0, out
        summaries[planner] = summary = json.loads(out.strip().splitlines()[-1])["summary"]
        assert summary["planner"] == planner
        mix = summary["mix"]
        assert mix["steps_all_active"] > 0 and mix["steps_tail"] > 0
        assert mix["steps_all_active"] + mix["steps_tail"] == summary["steps"]
        assert summary["sources"]["web"]["target"] == pytest.approx(0.7)
        assert summary["mix_max_abs_dev"] == mix["deviation"] <= MIX_TOLERANCE, planner
        assert summary["mix_tail_max_abs_dev"] == mix["tail_deviation"]
        assert summary["steps_per_epoch"] == {"steps": summary["steps"], "exact": True}
        ran_out = [mix["sources"][n]["epochs"][0]["ran_out_at_step"] for n in ("web", "code")]
        assert max(ran_out) == summary["steps"] - 1
    assert main(["plan", path, "--planner", "fastest"]) == 2
    assert "planner: must be one of 'naive', 'balanced', 'lookahead'" in capsys.readouterr().err
    # A plan cut short estimates the epoch's steps from the tokens left.
    rc = main(["plan", path, "--steps", "10", "--ranks", "8", "--json"])
    estimate = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]
    assert rc == 0 and estimate["steps_per_epoch"]["exact"] is False
    exact = summaries["balanced"]["steps"]
    assert abs(estimate["steps_per_epoch"]["steps"] - exact) <= max(2, 0.1 * exact)


def test_plan_reports_micro_batch_costs_and_the_1f1b_step_time(corpus, capsys):
    """Issue 20: per (rank, micro-batch) costs and the step's time under the pipeline model in
    `plan --json`, and the summary's balance efficiency (the work spread evenly over every row,
    over the 1F1B time)."""
    from streamload.plan.cost import pipeline_time
    path = write(corpus, "pipelined.toml",
                 LOADER.replace("seed = 3", "seed = 3\npipeline_stages = 2") + SOURCES)
    result = plan_json(capsys, path)
    summary, steps = result["summary"], result["steps"]
    assert summary["pipeline_stages"] == 2
    bound = total = 0.0
    for step in steps:
        rows = np.array(step["row_cost"])
        assert rows.shape == (4, 2)
        np.testing.assert_allclose(rows.sum(axis=1), step["rank_cost"], rtol=1e-9)
        assert step["step_time"] == pytest.approx(pipeline_time(rows, 2).max())
        bound += rows.sum() / 4 * (2 + 2 - 1) / (2 * 2)
        total += step["step_time"]
    assert summary["step_time_total"] == pytest.approx(total)
    assert summary["balance_efficiency"] == pytest.approx(bound / total)
    assert 0.5 < summary["balance_efficiency"] <= 1.0 + 1e-9
