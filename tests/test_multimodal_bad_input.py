"""Bad images: a DataError naming the source, shard, record, sample key and member; under
on_error="skip" a counted skip under the skip limit; too large an image resized or refused
with a message; a sample too long for a row refused (or dropped and counted)."""
from __future__ import annotations

import struct
import tarfile
import zlib

import pytest

import streamload as sl
from distributed import run_ranks
from imagecorpus import add_member, image_bytes, noise_bytes, options, write_tar
from test_multimodal_formats import documents, read_all

SOURCE = "pics"


def with_member(path, samples, bad: dict) -> None:
    """write_tar, plus for sample s the member bad[s] = (name suffix, bytes)."""
    def extra(tar: tarfile.TarFile, key: str, s: int) -> None:
        if s in bad:
            suffix, data = bad[s]
            add_member(tar, f"{key}.{suffix}", data)
    write_tar(path, samples, extra=extra)


def source(tmp_path, **kw) -> sl.Source:
    return sl.Source(str(tmp_path), name=SOURCE, images=options(**kw))


def truncated_jpeg() -> bytes:
    data = noise_bytes(64, 48, seed=3)
    return data[:len(data) // 2]


def png_that_does_not_inflate() -> bytes:
    """A PNG whose chunks all verify (their CRCs are right) but whose pixel data is no zlib
    stream: the header reads, the decode fails (at delivery)."""
    good = image_bytes(20, 20, fmt="PNG")
    ihdr_end = 8 + 8 + 13 + 4
    junk = bytes(range(7, 207))
    idat = struct.pack(">I", len(junk)) + b"IDAT" + junk + \
        struct.pack(">I", zlib.crc32(b"IDAT" + junk))
    iend = struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND"))
    return good[:ihdr_end] + idat + iend


@pytest.mark.timeout(120)
def test_a_corrupt_image_is_a_data_error_naming_its_sample_and_member(tmp_path):
    with_member(tmp_path / "part-0.tar", range(8), {2: ("9.jpg", truncated_jpeg())})
    with pytest.raises(sl.DataError) as error:
        read_all(source(tmp_path))
    message = str(error.value)
    for part in (f"source {SOURCE!r}", "shard 'part-0.tar'", "record 2", "sample '000002'",
                 "member '000002.9.jpg'", "truncated JPEG", 'on_error="skip"'):
        assert part in message, message


@pytest.mark.timeout(120)
def test_under_skip_a_corrupt_image_is_counted_and_the_rest_delivered(tmp_path):
    with_member(tmp_path / "part-0.tar", range(12),
                {2: ("9.jpg", truncated_jpeg()), 6: ("9.png", b"\x89PNG\r\n\x1a\nnope")})
    with sl.Loader([source(tmp_path)], micro_batch_tokens=1024, micro_batches=2, epochs=1,
                   on_error="skip", max_skip_fraction=0.5, decode_images_in="threads") as loader:
        ids = [i for b in loader for mb in b.micro_batches for i in mb.sample_ids]
        stats = loader.stats()["sources"][SOURCE]
    assert sorted(int(i.rsplit("/", 1)[1]) for i in ids) == [s for s in range(12)
                                                             if s not in (2, 6)]
    assert stats["skipped_records"] == 2
    reasons = " ".join(stats["skip_reasons"])
    assert "member '000002.9.jpg'" in reasons and "member '000006.9.png'" in reasons


@pytest.mark.timeout(120)
def test_the_skip_limit_holds_for_images(tmp_path):
    with_member(tmp_path / "part-0.tar", range(10),
                {s: ("9.jpg", b"garbage") for s in range(10)})
    with pytest.raises(sl.DataError, match="on_error='skip' skipped every one of the 10"):
        read_all(source(tmp_path), on_error="skip")


@pytest.mark.timeout(120)
def test_a_large_image_is_resized_to_the_budget_or_refused_by_the_cap(tmp_path):
    with_member(tmp_path / "part-0.tar", range(2), {0: ("9.jpg", image_bytes(2400, 1800))})
    docs = {sid: images for sid, _, _, _, images in documents(read_all(source(tmp_path)))}
    (grid, _, image), = docs[f"{SOURCE}/part-0.tar/0"]   # its one image, 4:3
    assert grid[1] * grid[2] * 196 <= 112 * 112 and tuple(image.shape) == (3, 84, 112)
    with pytest.raises(sl.DataError, match=r"member '000000.9.jpg': image of 2400x1800 = "
                                           r"4,320,000 pixels is larger than max_source_pix"):
        read_all(source(tmp_path, max_source_pixels=4_000_000))


@pytest.mark.timeout(120)
def test_a_sample_longer_than_a_row_is_refused_or_dropped_and_counted(tmp_path):
    with_member(tmp_path / "part-0.tar", range(3), {2: ("9.jpg", image_bytes(400, 400))})
    opts = dict(max_pixels=224 * 224)   # 64 visual tokens
    with pytest.raises(sl.DataError, match=r"sample '000002': \d+ tokens \(\d+ visual, in 3 "
                                           r"image\(s\)\) do not fit a row of micro_batch_"):
        read_all(source(tmp_path, **opts), micro_batch_tokens=96)
    with sl.Loader([source(tmp_path, **opts)], micro_batch_tokens=96, micro_batches=1,
                   epochs=1, long_documents="drop", decode_images_in="threads") as loader:
        ids = [i for b in loader for mb in b.micro_batches for i in mb.sample_ids]
        stats = loader.stats()["sources"][SOURCE]
    assert sorted(ids) == [f"{SOURCE}/part-0.tar/0", f"{SOURCE}/part-0.tar/1"]
    assert stats["dropped_documents"] == 1


@pytest.mark.timeout(120)
def test_an_image_that_reads_but_does_not_decode_fails_its_step_by_name(tmp_path):
    with_member(tmp_path / "part-0.tar", range(4), {2: ("9.png", png_that_does_not_inflate())})
    with pytest.raises(sl.DataError) as error:
        read_all(source(tmp_path))
    message = str(error.value)
    for part in (f"source {SOURCE!r}", "shard 'part-0.tar'", "record 2",
                 "image member '000002.9.png' does not decode", 'on_error="skip"'):
        assert part in message, message


def undecodable_job(rank, world, root, max_skip_fraction):
    with sl.Loader([sl.Source(root, name=SOURCE, images=options())], micro_batch_tokens=512,
                   micro_batches=2, epochs=1, seed=1, on_error="skip",
                   max_skip_fraction=max_skip_fraction, decode_images_in="threads") as loader:
        ids, images = [], 0
        for batch in loader:
            for mb in batch.micro_batches:
                ids += mb.sample_ids
                # the rows left are whole: one image per image_document, patches all there
                if mb.num_images:
                    assert int(mb.vision_cu_seqlens[-1]) == mb.pixel_values.shape[0]
                    assert int(mb.image_document.max()) < len(mb.sample_ids)
                images += mb.num_images
        stats = loader.stats()["sources"][SOURCE]
        return ids, images, stats["skipped_records"], stats["skip_reasons"]


@pytest.mark.timeout(240)
def test_under_skip_an_image_that_does_not_decode_leaves_its_row_counted_exactly_once(tmp_path):
    """The header reads, the pixels do not (found at delivery, on the rank the plan sent the
    sample to): under on_error="skip" the sample leaves its row, every other sample comes once,
    and the skip is counted by the rank that delivered it."""
    bad = {2: ("9.png", png_that_does_not_inflate()), 6: ("9.png", png_that_does_not_inflate())}
    with_member(tmp_path / "part-0.tar", range(0, 12), bad)
    write_tar(tmp_path / "part-1.tar", range(1000, 1012))
    out = run_ranks(undecodable_job, 2, str(tmp_path), 0.5)
    ids = out[0][0] + out[1][0]
    assert len(ids) == len(set(ids)) == 22
    assert f"{SOURCE}/part-0.tar/2" not in ids and f"{SOURCE}/part-0.tar/6" not in ids
    assert out[0][2] + out[1][2] == 2
    reasons = " ".join(out[0][3] + out[1][3])
    assert "part-0.tar/2: image member '000002.9.png' does not decode" in reasons, reasons
    assert "member '000006.9.png'" in reasons


@pytest.mark.timeout(120)
def test_the_skip_limit_holds_for_images_that_do_not_decode(tmp_path):
    with_member(tmp_path / "part-0.tar", range(6),
                {s: ("9.png", png_that_does_not_inflate()) for s in range(6)})
    with pytest.raises(sl.DataError, match="on_error='skip' skipped every one|skipped all"):
        read_all(source(tmp_path), on_error="skip", max_skip_fraction=0.5)
