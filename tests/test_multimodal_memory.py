"""The memory budget counts an image source's encoded images: a buffered token of an image
source costs TOKEN_BYTES plus `Images.encoded_bytes_per_token` (issue 23), so its buffers and
windows are sized for the JPEG they hold, not for 4 bytes a token."""
from __future__ import annotations

import numpy as np
import pytest

import streamload as sl
from imagecorpus import options, write_tar
from streamload.config import make_config
from streamload.errors import ConfigError
from streamload.plan.memory import TOKEN_BYTES, MemoryPlan, source_token_bytes

pytestmark = pytest.mark.core


def config(**kw):
    return make_config(**{"micro_batch_tokens": 1024, "micro_batches": 2, "chunk_bytes": 4096,
                          "planner": "balanced", **kw})


def test_an_image_source_costs_its_encoded_bytes_per_token():
    text = sl.Source("/data/text", name="text")
    pics = sl.Source("/data/pics", name="pics", images=options())
    lean = sl.Source("/data/lean", name="lean", images=options(encoded_bytes_per_token=0))
    assert source_token_bytes([text, pics, lean]).tolist() == [TOKEN_BYTES, TOKEN_BYTES + 256,
                                                               TOKEN_BYTES]
    with pytest.raises(ConfigError, match="encoded_bytes_per_token"):
        options(encoded_bytes_per_token=-1)


def test_the_buffers_fit_the_budget_with_the_image_bytes_counted():
    token_bytes = np.array([TOKEN_BYTES, TOKEN_BYTES + 256])
    budget = 4 << 20
    plan = MemoryPlan(config(memory_budget=budget), np.array([0.5, 0.5]), ["text", "pics"], 4,
                      token_bytes)
    flat = MemoryPlan(config(memory_budget=budget), np.array([0.5, 0.5]), ["text", "pics"], 4)
    # the image source's last shard is on this rank alone: its window would be four times as deep
    now = (np.array([0.5, 0.5]), np.array([4, 1]), np.array([True, True]))
    got, old = plan.budgets(*now), flat.budgets(*now)
    held = sum(b.capacity_tokens * t for b, t in zip(got, token_bytes.tolist()))
    assert held + 2 * 4096 <= budget                      # buffers + a range each fit
    # counted at 4 bytes a token, the image buffer alone would overrun the budget
    assert old[1].capacity_tokens * (TOKEN_BYTES + 256) > budget
    assert 1024 <= got[1].window_tokens < old[1].window_tokens   # shrunk, still a row
    # and a budget that 4 bytes a token would pass is refused, naming the source
    MemoryPlan(config(memory_budget=1 << 20), np.array([0.5, 0.5]), ["text", "pics"], 4)
    with pytest.raises(ConfigError, match="'pics'"):
        MemoryPlan(config(memory_budget=1 << 20), np.array([0.5, 0.5]), ["text", "pics"], 4,
                   token_bytes)


def test_the_default_budget_grows_to_hold_the_image_buffers():
    token_bytes = np.array([TOKEN_BYTES, TOKEN_BYTES + 256])
    plan = MemoryPlan(config(micro_batch_tokens=16384), np.array([0.5, 0.5]), ["text", "pics"],
                      8, token_bytes)
    got = plan.initial(np.array([0.5, 0.5]))
    assert plan.budget > 32 << 20
    assert sum(b.capacity_tokens * t for b, t in zip(got, token_bytes.tolist())) <= plan.budget


def test_a_budget_too_small_for_the_images_names_the_source(tmp_path):
    (tmp_path / "pics").mkdir()
    write_tar(tmp_path / "pics" / "part-0.tar", range(8))
    source = sl.Source(str(tmp_path / "pics"), name="pics", images=options())
    kw = dict(micro_batch_tokens=1024, micro_batches=2, chunk_bytes=4096, epochs=1,
              decode_images_in="threads")
    # buffer (2 windows + a row = 5 rows) at 4 bytes a token fits in 256 KiB; with the images not
    with pytest.raises(ConfigError, match="'pics'.*memory_budget|memory_budget.*'pics'"):
        sl.Loader([source], memory_budget=256 << 10, **kw)
    lean = sl.Source(str(tmp_path / "pics"), name="pics",
                     images=options(encoded_bytes_per_token=0))
    with sl.Loader([lean], memory_budget=256 << 10, **kw) as loader:
        assert sum(len(b.micro_batches) for b in loader) > 0
