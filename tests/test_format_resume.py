"""Exactly-once and elastic resume for every format: 2 gloo ranks stop after a few steps, one
rank resumes from their state, and every document comes exactly once over both runs."""
from __future__ import annotations

import pytest

import streamload as sl
from distributed import run_ranks
from test_format_commands import TEXTS, WRITERS
from test_format_litdata import litdata_root  # noqa: F401  (a fixture: litdata's own writer)

STOP_AFTER = 3


def loader_for(root: str, fmt: str, **kw) -> sl.Loader:
    field = {"tokens_field": "tokens"} if fmt == "mds" else {}
    if fmt == "litdata":
        field = {"format": "litdata"}
    return sl.Loader([sl.Source(root, **field)], micro_batch_tokens=1024, micro_batches=1,
                     epochs=1, seed=4, **kw)


def head_job(rank, world, root, fmt):
    with loader_for(root, fmt) as loader:
        ids, tokens = [], 0
        for batch in loader:
            ids += [i for mb in batch.micro_batches for i in mb.sample_ids]
            tokens += sum(mb.num_tokens for mb in batch.micro_batches)
            if batch.step + 1 == STOP_AFTER:
                return ids, loader.state_dict(), tokens


def documents(ids) -> set[str]:
    return {i.partition(":")[0] for i in ids}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fmt", sorted(WRITERS) + ["litdata"])
def test_elastic_resume_delivers_every_document_once(tmp_path, fmt, request):
    if fmt == "litdata":
        root = request.getfixturevalue("litdata_root")[0] / "text_plain"
        expected = None
    else:
        root = tmp_path / fmt
        root.mkdir()
        WRITERS[fmt](root)
        expected = len(TEXTS)
    heads = run_ranks(head_job, 2, str(root), fmt)
    assert heads[0][1] == heads[1][1]                      # every rank saves the same state
    with loader_for(str(root), fmt) as loader:             # one rank resumes
        loader.load_state_dict(heads[0][1])
        tail = [mb for b in loader for mb in b.micro_batches]
    ids = [i for head_ids, _, _ in heads for i in head_ids] + \
        [i for mb in tail for i in mb.sample_ids]
    assert len(ids) == len(set(ids)), "a sample delivered twice"
    with loader_for(str(root), fmt) as loader:             # the uninterrupted epoch
        full = [mb for b in loader for mb in b.micro_batches]
    assert documents(ids) == documents(i for mb in full for i in mb.sample_ids)
    if expected is not None:
        assert len(documents(ids)) == expected
    # Nothing lost inside documents either: the tokens add up to the uninterrupted epoch's.
    head_tokens = sum(tokens for _, _, tokens in heads)
    assert head_tokens + sum(mb.num_tokens for mb in tail) == sum(mb.num_tokens for mb in full)


def write_one_shard(root, fmt):
    """One shard of TEXTS (as byte-valued token ids where the format holds ids), in many
    ranges: 5-row Parquet row groups, 1 KiB reads elsewhere."""
    import numpy as np
    docs = [np.frombuffer(t.encode(), np.uint8).astype(np.uint16) for t in TEXTS]
    if fmt == "tokens":
        from streamload.formats import write_token_shard
        write_token_shard(root / "part-0", docs)
    elif fmt == "megatron":
        from streamload.formats.megatron import write_megatron_dataset
        write_megatron_dataset(str(root / "part-0"), docs, np.uint16)
    elif fmt == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq
        # Long, uncompressed rows: the footer's first read takes the file's last 64 KiB, so
        # the row groups must hold far more than that for the skipped ones to show.
        pq.write_table(pa.table({"text": [t * 10 for t in TEXTS]}), root / "part-0.parquet",
                       row_group_size=5, compression="none", use_dictionary=False)
    else:   # mds, one raw shard
        from test_format_mds import reference
        MDSWriter, _ = reference()
        with MDSWriter(out=str(root), columns={"tokens": "ndarray:int32"},
                       size_limit=1 << 24) as w:
            for d in docs:
                w.write({"tokens": d.astype(np.int32)})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["tokens", "megatron", "parquet", "mds"])
def test_a_resumed_shard_reads_only_what_it_still_delivers(tmp_path, fmt):
    """Resuming late in a shard of an indexed format reads the ranges it still delivers, not
    the bytes of the documents delivered before the stop; the rest arrives exactly as in an
    uninterrupted run."""
    from resumecheck import full_run, stop_and_resume
    write_one_shard(tmp_path, fmt)
    def loader():
        return loader_for(str(tmp_path), fmt, chunk_bytes=1024, prefetch_steps=1)
    full = full_run(loader)
    run = stop_and_resume(loader, int(len(full[0]) * 0.7), full)
    assert run.head + run.tail == run.full
    resumed_bytes, full_bytes = run.resumed_stats["bytes_read"], run.full_stats["bytes_read"]
    assert resumed_bytes < 0.6 * full_bytes, (resumed_bytes, full_bytes, len(run.full))
