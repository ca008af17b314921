"""Hybrid balancing of image-text samples (issue 23, items 4 and 6): epoch efficiency when the
planner sees the vision encoder's cost, against backbone-only balancing and against a baseline
that packs by token count only (as Megatron-Energon's packing does).

    python benchmarks/multimodal_balance.py                    # R=2,4 on gloo + R=64 simulated
    python benchmarks/multimodal_balance.py --no-loader        # the R=64 simulation only
    python benchmarks/multimodal_balance.py --sim-ranks 64,256 --loader-ranks 2

Cost (a sample = encoder(images) + backbone(fused length), the schedule: within a rank the
encoder over its images, then the backbone over its rows, so a rank's step time is the sum of
both over its samples):
  * backbone, 7B-like: cost_a*L^2 + cost_b*L over each document's fused length L (text plus
    visual tokens plus image markers), cost_a = 1/49152, cost_b = 1 (the loader's default);
  * encoder, ViT-600M-like (32 layers, width 1280, bidirectional within each image):
    a_e*P^2 + b_e*P per image over its P patches, a_e = 12*32*1280 / (6*7e9),
    b_e = 6*600e6 / (6*7e9) (FLOPs relative to the 7B backbone's b; the loader's default
    `encoder_cost_a` / `encoder_cost_b`).

Corpus (seeded): image-text samples with 0-8 images each (a quarter with none, the rest
uniform 1-8), each of a resolution drawn from 320x240 to 1920x1080 plus portrait and panorama
shapes, placed by the Qwen2-VL rule (`vision.qwen2_vl()`: patch 14, merge 2, at most 1024 x 28^2
pixels: up to 4096 patches, 1024 visual tokens per image); text of 10 to 6,000 tokens
(log-uniform), cut so a sample fits one row of C tokens. The encoder's share of the compute and
the images' share (encoder plus their visual tokens in the backbone) are reported.

--corpus documents: pages and screenshots (A4 / letter scans, desktop and phone screenshots,
slides, charts: DOC_SIZES), 1-4 per sample (15% with none), under a ~2 MP Qwen2-VL rule
(max_pixels = 2560 x 28^2), text of 10 to 2,000 tokens: the encoder carries 38% of the compute
(the photos corpus: 25%), the images (encoder plus their visual tokens) 95%.

--corpus mix: the sources of a VLM instruction-tuning mix at LLaVA-OneVision's stage-2 weights
(MIX below: photo QA 43.7%, documents 23.0%, text only 11.1%, interleaved multi-image 13.6%,
video clips as lists of 8-32 frames 8.5%, by samples), pre-mixed into one shuffled stream,
under one ~2 MP Qwen2-VL rule: the encoder carries 31% of the compute, the images 84%.
`corpora` in the JSON has each source's share of the samples, the compute and the encoder's.

Geometry: rows of C = 16384 tokens, M = 2 micro-batches per rank (--micro-batches), one epoch.

Modes:
  * hybrid:   the loader's default for image sources (`image_cost="hybrid"`): the encoder's
              cost from each image's patches reaches the planner as the sample's extra cost;
              each step's plan then has its top rank trade items with the others
              (`plan/swaps.py`; --no-swaps plans without);
  * backbone: `image_cost="backbone"`: the planner balances the fused length's cost only;
  * token_baseline: the samples shuffled, packed in order into rows of at most C tokens (a
              sample that does not fit starts the next row), rows dealt round-robin, M per
              rank per step (what a per-worker packer by token count gives; no cost model);
              full steps only (the remainder is dropped, as long_context.py's baseline does);
  * energon_ffd: each rank packs its own shuffled stream by token count, first-fit
              decreasing within packing buffers of --packing-buffer samples (an Energon
              `select_samples_to_pack` greedy knapsack), M rows per rank per step.

Efficiency = the perfectly balanced time for the same work / the actual time, summed over the
epoch's steps: a step's bound is its work (encoder + backbone) over R ranks, its time the
slowest rank's encoder + backbone (benchmarks/long_context.py's definition at P = 1).
The epoch's last step, the same rule as benchmarks/long_context.py: the loader's planners
(hybrid, backbone) are scored over every step they plan, the last, partial one included (it
holds what is left); the baselines pack full steps only and drop the remainder (a part-empty
last step would count against them). `efficiency_but_last` scores the planners without their
last step, for reference (long_context.py reports `fill_but_last` alike).
`exchanged` (dry run): the share of the taken tokens planned onto a rank other than the one
holding them (the exchange's traffic).
encoder_efficiency / backbone_efficiency: the same for each part alone (how evenly each part
is spread), encoder_imbalance / backbone_imbalance: max/mean over ranks, averaged over steps.

R=64 ("sim"): the dry run itself (`commands.dryrun.simulate`, what `streamload plan` runs),
fed the corpus as its scan reads an image source: each sample's fused length and its images'
patches (`SourceScan.image_patches`), in shards of SHARD_SAMPLES dealt as the loader deals
them; the dry run hands each item's encoder cost to the planner as the loader's runtime does,
keeps the caps per row (--max-images-per-row, --max-patches-per-row) and reports each step's
encoder and backbone cost per rank. R=2, 4 ("loader"): real gloo ranks
running `streamload.Loader` over a WebDataset of real JPEGs (flat colours, so decoding stays
cheap on a loaded machine) of the same kind of corpus; costs measured from the delivered
micro-batches (`cu_seqlens`, `image_grid`, `image_document`).

The last line is the JSON of everything.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import io
import json
import os
import sys
import tarfile
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

C, M = 16384, 2
MAX_PIXELS = 1024 * 28 * 28   # Qwen2-VL's processor default here; --max-pixels (sim only)
COST_A, COST_B = 1.0 / 49152, 1.0
ENC_A, ENC_B = 12.0 * 32 * 1280 / 42e9, 3.6e9 / 42e9
SIZES = [(320, 240), (640, 480), (800, 600), (1024, 768), (1280, 720), (1920, 1080),
         (480, 640), (768, 1024), (1080, 1920), (1600, 400), (2048, 512)]
# --corpus documents: pages and screenshots (A4 / letter scans at 150-300 dpi, desktop and
# phone screenshots, slides, charts), 1-4 per sample (15% with none), under a ~2 MP rule
# (Qwen2-VL max_pixels = 2560 x 28^2: up to 10,240 patches, 2,560 visual tokens per image),
# text of 10 to 2,000 tokens (questions, answers, OCR snippets).
DOC_SIZES = [(1240, 1754), (1275, 1650), (1654, 2339), (2480, 3508), (1280, 800), (1366, 768),
             (1920, 1080), (2560, 1440), (1170, 2532), (1080, 2400), (1024, 768), (800, 600)]
# A shape of sample: (sizes to draw from, images per sample lo..hi when it has any, share with
# none, text tokens lo..hi, log-uniform).
PHOTOS = (SIZES, (1, 8), 0.25, (10, 6000))
DOCUMENTS = (DOC_SIZES, (1, 4), 0.15, (10, 2000))
# --corpus mix: the sources of a VLM instruction-tuning mix at LLaVA-OneVision's stage-2 weights
# (arXiv 2408.03326: 3.2M single-image samples, split General 36.1%, Doc/Chart/Screen 20.6%,
# Math/Reasoning 20.1%, General OCR 8.9%, Language 14.3%; then 0.56M multi-image and 0.35M
# video samples; 4.11M in all), by samples, pre-mixed into one shuffled stream (one source):
#   photo  (General + Math/Reasoning, 43.7%): one photo, a question and answer of 20-1,500 tokens;
#   doc    (Doc/Chart/Screen + General OCR, 23.0%): 1-2 pages or screenshots, 20-2,000 tokens;
#   text   (Language, 11.1%): text only, 50-4,000 tokens;
#   interleaved (multi-image, 13.6%): 2-8 web images (WEB_SIZES), 200-4,000 tokens of text;
#   video  (8.5%): a clip of 8-32 frames as an image list, each sampled at 448x252 (or
#          252x448), 20-1,000 tokens.
# One resizing rule for all (one source): Qwen2-VL's dynamic rule at max_pixels = 2560 x 28^2
# (~2 MP: up to 2,560 visual tokens per image); a frame of 448x252 is 576 patches, 144 tokens
# (LLaVA-OneVision: 196 per frame). Chosen before it was measured, not tuned.
WEB_SIZES = [(320, 240), (400, 300), (500, 375), (640, 480), (800, 600), (1024, 768),
             (1280, 720), (600, 800)]
FRAMES = [(448, 252)] * 4 + [(252, 448)]
MIX = (  # name, weight (samples), shape
    ("photo", 0.437, (SIZES, (1, 1), 0.0, (20, 1500))),
    ("doc", 0.230, (DOC_SIZES, (1, 2), 0.0, (20, 2000))),
    ("text", 0.111, (SIZES, (0, 0), 1.0, (50, 4000))),
    ("interleaved", 0.136, (WEB_SIZES, (2, 8), 0.0, (200, 4000))),
    ("video", 0.085, (FRAMES, (8, 32), 0.0, (20, 1000))),
)
CORPORA = {
    # name: ((weight, shape) per source, max_pixels)
    "photos": (((1.0, PHOTOS),), 1024 * 28 * 28),
    "documents": (((1.0, DOCUMENTS),), 2560 * 28 * 28),
    "mix": (tuple((w, shape) for _, w, shape in MIX), 2560 * 28 * 28),
}
IMAGE_ID, BEGIN_ID, END_ID = 300, 301, 302


def images_options():
    from streamload.vision import qwen2_vl
    return qwen2_vl(IMAGE_ID, BEGIN_ID, END_ID, max_pixels=MAX_PIXELS)


# -- the corpus ------------------------------------------------------------------------------
@dataclasses.dataclass
class Corpus:
    text: np.ndarray            # int64 [n] text tokens
    sizes: list                 # per sample: [(w, h), ...]
    patches: list               # per sample: [P, ...]
    fused: np.ndarray           # int64 [n] fused length (text + visual tokens + markers)
    source: np.ndarray          # int64 [n] which of the corpus's sources (--corpus mix)


def make_corpus(n: int, seed: int = 0, kind: str = "photos") -> Corpus:
    sources, _ = CORPORA[kind]
    rng = np.random.default_rng(seed)
    opts = images_options()
    weights = np.array([w for w, _ in sources])
    text, sizes, patches, fused, source = [], [], [], [], []
    for _ in range(n):
        # one source: no draw for it (the single-shape corpora as in the rounds before)
        which = 0 if len(sources) == 1 else int(rng.choice(len(sources), p=weights / weights.sum()))
        table, (lo, hi), none, (text_lo, text_hi) = sources[which][1]
        k = 0 if (hi == 0 or rng.random() < none) else int(rng.integers(lo, hi + 1))
        wh = [table[int(rng.integers(len(table)))] for _ in range(k)]
        placed = [opts.place(h, w) for w, h in wh]
        # a sample's images must leave room for its text in a row: the last ones go (the
        # mix's interleaved or video samples only, rarely)
        while placed and sum(p.tokens + 2 for p in placed) > C - text_lo:
            placed.pop()
            wh.pop()
        visual = sum(p.tokens + 2 for p in placed)   # + the begin and end markers
        t = int(np.exp(rng.uniform(np.log(text_lo), np.log(text_hi))))
        t = max(1, min(t, C - visual))
        text.append(t)
        sizes.append(wh)
        patches.append([p.grid[0] * p.grid[1] * p.grid[2] for p in placed])
        fused.append(t + visual)
        source.append(which)
    return Corpus(np.array(text, np.int64), sizes, patches, np.array(fused, np.int64),
                  np.array(source, np.int64))


def sample_costs(corpus: Corpus) -> tuple[np.ndarray, np.ndarray]:
    from streamload.plan.cost import CostModel
    from streamload.vision.cost import EncoderCost
    backbone = CostModel(COST_A, COST_B).doc_cost(corpus.fused).astype(np.float64)
    encoder = EncoderCost(ENC_A, ENC_B).sample_costs(corpus.patches)
    return backbone, encoder


def shares(corpus: Corpus) -> dict:
    backbone, encoder = sample_costs(corpus)
    visual = corpus.fused - corpus.text
    # the images' part of the backbone: their tokens' share of each document's cost
    image_backbone = backbone * visual / np.maximum(corpus.fused, 1)
    total = backbone.sum() + encoder.sum()
    return {"samples": int(corpus.fused.size),
            "images": int(sum(len(p) for p in corpus.patches)),
            "encoder_share": round(float(encoder.sum() / total), 4),
            "image_share": round(float((encoder.sum() + image_backbone.sum()) / total), 4),
            "mean_fused_tokens": round(float(corpus.fused.mean()), 1),
            **({} if corpus.source.max(initial=0) == 0 else {"by_source": {
                name: {"samples": round(float((corpus.source == k).mean()), 4),
                       "compute": round(float((backbone + encoder)[corpus.source == k].sum()
                                              / total), 4),
                       "encoder": round(float(encoder[corpus.source == k].sum() / total), 4),
                       "mean_fused_tokens":
                           round(float(corpus.fused[corpus.source == k].mean()), 1)}
                for k, (name, _, _) in enumerate(MIX)}})}


# -- scoring ---------------------------------------------------------------------------------
def score(enc: np.ndarray, bb: np.ndarray) -> dict:
    """enc, bb: [steps, R] each rank's encoder and backbone cost per step."""
    total = enc + bb
    R = total.shape[1]

    def eff(x):
        t = x.max(axis=1).sum()
        return float(x.sum() / R / t) if t > 0 else 1.0

    def imb(x):
        mean = x.mean(axis=1)
        ok = mean > 0
        return float((x.max(axis=1)[ok] / mean[ok]).mean()) if ok.any() else 1.0
    return {"steps": int(total.shape[0]), "efficiency": round(eff(total), 4),
            # the epoch's last step holds what is left (the baseline drops it)
            "efficiency_but_last": round(eff(total[:-1]), 4) if total.shape[0] > 1 else None,
            "encoder_efficiency": round(eff(enc), 4), "backbone_efficiency": round(eff(bb), 4),
            "imbalance": round(imb(total), 4), "encoder_imbalance": round(imb(enc), 4),
            "backbone_imbalance": round(imb(bb), 4),
            "time": float(total.max(axis=1).sum()), "work": float(total.sum())}


def token_baseline(corpus: Corpus, R: int, seed: int) -> dict:
    """Shuffled, packed in order into rows of <= C tokens, rows dealt round-robin."""
    backbone, encoder = sample_costs(corpus)
    order = np.random.default_rng(seed + 1).permutation(corpus.fused.size)
    rows, used, row = [], 0, -1
    for i in order:
        if row < 0 or used + corpus.fused[i] > C:
            row, used = row + 1, 0
        rows.append(row)
        used += int(corpus.fused[i])
    rows = np.array(rows)
    n_rows = row + 1
    # full steps only (the remainder, under a step, is dropped as benchmarks/long_context.py's
    # baseline drops it: a part-empty last step would count against the baseline)
    steps = max(n_rows // (R * M), 1)
    keep = rows < steps * R * M
    enc_rows = np.bincount(rows[keep], weights=encoder[order][keep], minlength=steps * R * M)
    bb_rows = np.bincount(rows[keep], weights=backbone[order][keep], minlength=steps * R * M)
    # round-robin: consecutive rows to ranks 0..R-1, then the next micro-batch
    enc = enc_rows.reshape(steps, M, R).sum(axis=1)
    bb = bb_rows.reshape(steps, M, R).sum(axis=1)
    fill = float(corpus.fused[order][keep].sum()) / (steps * R * M * C)
    return {**score(enc, bb), "fill": round(fill, 4), "samples": int(keep.sum())}


def energon_baseline(corpus: Corpus, R: int, seed: int, buffer: int = 64) -> dict:
    """What a Megatron-Energon user gets: each DP rank reads its own samples (a shuffled
    stream per rank) and packs them by token count only, in packing buffers of `buffer`
    samples, first-fit decreasing into rows of at most C tokens (the greedy knapsack of
    Megatron-LM's multimodal example's `select_samples_to_pack`); a rank takes its next M rows
    per step. Full steps only: the epoch ends with the rank that runs out first."""
    backbone, encoder = sample_costs(corpus)
    order = np.random.default_rng(seed + 1).permutation(corpus.fused.size)
    per_rank_rows = []
    for r in range(R):
        mine = order[r::R]
        rows = []   # (encoder, backbone, tokens, samples) per row, in order
        for at in range(0, mine.size, buffer):
            chunk = mine[at:at + buffer]
            chunk = chunk[np.argsort(-corpus.fused[chunk], kind="stable")]
            room, enc, bb, tok, count = [], [], [], [], []
            for i in chunk.tolist():
                length = int(corpus.fused[i])
                k = next((j for j, left in enumerate(room) if left >= length), None)
                if k is None:
                    room.append(C)
                    enc.append(0.0)
                    bb.append(0.0)
                    tok.append(0)
                    count.append(0)
                    k = len(room) - 1
                room[k] -= length
                enc[k] += float(encoder[i])
                bb[k] += float(backbone[i])
                tok[k] += length
                count[k] += 1
            rows += list(zip(enc, bb, tok, count))
        per_rank_rows.append(rows)
    steps = max(min(len(rows) for rows in per_rank_rows) // M, 1)
    enc = np.array([[sum(row[0] for row in rows[t * M:(t + 1) * M]) for rows in per_rank_rows]
                    for t in range(steps)])
    bb = np.array([[sum(row[1] for row in rows[t * M:(t + 1) * M]) for rows in per_rank_rows]
                   for t in range(steps)])
    tokens = sum(row[2] for rows in per_rank_rows for row in rows[:steps * M])
    samples = sum(row[3] for rows in per_rank_rows for row in rows[:steps * M])
    return {**score(enc, bb), "fill": round(tokens / (steps * R * M * C), 4),
            "samples": int(samples)}


# -- R=64: the job model on item lengths, with the encoder cost as the loader hands it ------
def loader_options(mode: str, seed: int = 0) -> dict:
    return dict(micro_batch_tokens=C, micro_batches=M, cost_a=COST_A, cost_b=COST_B,
                encoder_cost_a=ENC_A, encoder_cost_b=ENC_B, image_cost=mode, epochs=1,
                seed=seed)


SHARD_SAMPLES = 64   # samples per (virtual) shard of the simulated source


def simulate(corpus: Corpus, R: int, mode: str, seed: int = 0, **options) -> dict:
    """The dry run itself (`commands.dryrun.simulate`, what `streamload plan` runs) on the
    corpus as its scan would read it: each sample's fused length and its images' patches
    (`SourceScan.image_patches`), in shards of SHARD_SAMPLES dealt to ranks as the loader deals
    them. Each step's encoder and backbone cost per rank come from its report."""
    import streamload as sl
    from streamload.commands.dryrun import SourceScan
    from streamload.commands.dryrun import simulate as dry_run
    from streamload.configfile import LoaderSpec
    # The scan refuses a sample that alone exceeds a cap per row (the loader does too); this
    # corpus skips the scan, so it refuses the caps instead.
    for cap, per_sample in (("max_images_per_row", max(map(len, corpus.patches))),
                            ("max_patches_per_row", max(map(sum, corpus.patches)))):
        if options.get(cap) is not None and per_sample > options[cap]:
            raise SystemExit(f"{cap}={options[cap]}: a sample of this corpus alone holds "
                             f"{per_sample} (the loader would refuse it); raise the cap")
    spec = LoaderSpec("multimodal", [sl.Source("/bench/mm/", name="mm",
                                               images=images_options())],
                      {**loader_options(mode, seed), **options})
    n = corpus.fused.size
    shard_items = np.diff(np.append(np.arange(0, n, SHARD_SAMPLES), n))
    scan = SourceScan("mm", "webdataset", "scan", corpus.fused.astype(np.int64),
                      shard_items.astype(np.int64), shards=shard_items.size,
                      shards_read=shard_items.size, documents=n,
                      image_patches=[tuple(p) for p in corpus.patches])
    started = time.process_time()
    reports = dry_run(spec, [scan], steps=10 ** 6, ranks=R)
    cpu = time.process_time() - started
    enc = np.array([r.encoder_cost for r in reports])
    bb = np.array([r.backbone_cost for r in reports])
    taken = int(sum(int(r.samples.sum()) for r in reports))
    res = score(enc, bb)
    res.update({"fill": round(float(np.mean([r.fill for r in reports])), 4), "samples": taken,
                "all_samples_once": taken == n,
                "row_images_max": int(max(r.row_visual[..., 0].max() for r in reports)),
                "row_patches_max": int(max(r.row_visual[..., 1].max() for r in reports)),
                # the share of the taken tokens planned away from the rank holding them (the
                # exchange's traffic; an image item moves with its pixels)
                "exchanged": round(sum(r.exchanged for r in reports) /
                                   max(sum(int(r.rank_tokens.sum()) for r in reports), 1), 4),
                "plan_ms_mean": round(1e3 * float(np.mean([r.plan_seconds for r in reports])),
                                      2),
                "sim_cpu_s": round(cpu, 1)})
    return res


# -- R=2, 4: the Loader on gloo over real JPEGs ----------------------------------------------
def jpeg(w: int, h: int, color) -> bytes:
    from PIL import Image
    out = io.BytesIO()
    Image.new("RGB", (w, h), color).save(out, "JPEG", quality=85)
    return out.getvalue()


def write_tars(root: Path, corpus: Corpus, shards: int = 4) -> None:
    """WebDataset tars: `KEY.txt` (text tokens as bytes: the loader's byte tokenizer) and
    `KEY.{k}.jpg` (images first, then the text)."""
    root.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, corpus.fused.size, shards + 1).round().astype(int)
    for s in range(shards):
        with tarfile.open(root / f"part-{s:05d}.tar", "w") as tar:
            for i in range(bounds[s], bounds[s + 1]):
                key = f"{i:06d}"
                members = [(f"{key}.txt", b"a" * int(corpus.text[i]))]
                members += [(f"{key}.{k}.jpg", jpeg(w, h, (40 + 20 * k, 90, 160)))
                            for k, (w, h) in enumerate(corpus.sizes[i])]
                for name, data in members:
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def run_rank(rank: int, world: int, port: int, root: str, options: dict, queue) -> None:
    try:
        global MAX_PIXELS
        MAX_PIXELS = options.pop("max_pixels", MAX_PIXELS)
        if not options.pop("swaps", True):
            from streamload.plan import planner
            planner.SWAPS = False
        import torch
        torch.set_num_threads(1)
        if world > 1:
            import torch.distributed as dist
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world, timeout=datetime.timedelta(seconds=600))
        import streamload as sl
        from streamload.plan.cost import CostModel
        from streamload.vision.cost import EncoderCost
        backbone, encoder = CostModel(COST_A, COST_B), EncoderCost(ENC_A, ENC_B)
        steps, enc, bb, ids, planned, tokens = [], [], [], [], [], 0
        with sl.Loader([sl.Source(root, name="mm", images=images_options())],
                       decode_images_in="threads", image_workers=1, **options) as loader:
            for batch in loader:
                e = b = 0.0
                for mb in batch.micro_batches:
                    seg = np.diff(mb.cu_seqlens.numpy()).astype(np.int64)
                    b += float(backbone.doc_cost(seg).sum())
                    tokens += int(seg.sum())
                    if mb.num_images:
                        grid = mb.image_grid.numpy().astype(np.int64)
                        e += float(encoder.image_costs(grid.prod(axis=1)).sum())
                    ids += list(mb.sample_ids)
                steps.append(int(batch.step))
                enc.append(e)
                bb.append(b)
                planned.append(batch.rank_cost_of(rank))
        queue.put({"rank": rank, "steps": steps, "enc": enc, "bb": bb, "ids": ids,
                   "planned": planned, "tokens": tokens})
        if world > 1:
            import torch.distributed as dist
            dist.destroy_process_group()
    except BaseException:
        queue.put({"rank": rank, "error": traceback.format_exc()})
        raise


def loader_run(root: Path, corpus: Corpus, R: int, mode: str, seed: int = 0,
               swaps: bool = True) -> dict:
    from epoch import spawn_ranks
    # the ranks are fresh processes: they get the corpus's resizing rule with the options
    ranks = spawn_ranks(run_rank, R, 1800.0, str(root),
                        {**loader_options(mode, seed), "max_pixels": MAX_PIXELS,
                         "swaps": swaps})
    T = max(len(r["steps"]) for r in ranks)
    enc, bb = np.zeros((T, R)), np.zeros((T, R))
    for q, r in enumerate(ranks):
        enc[:len(r["enc"]), q] = r["enc"]
        bb[:len(r["bb"]), q] = r["bb"]
    ids = [i for r in ranks for i in r["ids"]]
    res = score(enc, bb)
    # what the planner predicted per rank against the measured parts (hybrid: equal)
    planned = np.array([sum(r["planned"]) for r in ranks])
    res.update({"samples": len(ids), "exactly_once": len(ids) == len(set(ids)) == corpus.fused.size,
                "same_steps_all_ranks": all(r["steps"] == ranks[0]["steps"] for r in ranks),
                "fill": round(sum(r["tokens"] for r in ranks) / (T * R * M * C), 4),
                "planned_over_measured": round(float(planned.sum() / (enc.sum() + bb.sum())), 4)})
    return res


def row(mode: str, where: str, R: int, res: dict, base: dict | None,
        energon: dict | None = None) -> dict:
    out = {"mode": where, "ranks": R, "balancing": mode, **res}
    out["speedup_vs_token_baseline"] = round(res["efficiency"] / base["efficiency"], 4) \
        if base else 1.0
    if energon is not None:
        out["speedup_vs_energon_ffd"] = round(res["efficiency"] / energon["efficiency"], 4)
    out.pop("time", None)
    out.pop("work", None)
    return out


def print_row(r: dict) -> None:
    keys = ("efficiency", "efficiency_but_last", "speedup_vs_token_baseline",
            "speedup_vs_energon_ffd", "exchanged", "plan_ms_mean",
            "encoder_efficiency",
            "backbone_efficiency", "encoder_imbalance", "backbone_imbalance", "fill", "steps")
    print(f"{r['mode']:>6} R={r['ranks']:<4} {r['balancing']:>14} " +
          " ".join(f"{k}={r.get(k)}" for k in keys), file=sys.stderr, flush=True)


def main(argv=None) -> int:
    global C, M, MAX_PIXELS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sim-ranks", default="64")
    ap.add_argument("--sim-steps", type=int, default=32,
                    help="epoch length of the simulated corpus, in full steps (about)")
    ap.add_argument("--loader-ranks", default="2,4")
    ap.add_argument("--loader-samples", type=int, default=160)
    ap.add_argument("--no-loader", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default="/tmp/streamload-mm-balance")
    ap.add_argument("--capacity", type=int, default=C, help="C, tokens per row (sim only)")
    ap.add_argument("--max-pixels", type=int, default=None,
                    help="the resizing rule's pixel budget per image (sim only; default: the "
                         "corpus's)")
    ap.add_argument("--lookahead", type=int, default=None,
                    help="the lookahead planner's window W in steps (default: the loader's)")
    ap.add_argument("--max-images-per-row", type=int, default=None)
    ap.add_argument("--max-patches-per-row", type=int, default=None)
    ap.add_argument("--packing-buffer", type=int, default=64,
                    help="samples per packing buffer of the Energon-like baseline")
    ap.add_argument("--micro-batches", type=int, default=M,
                    help="M, rows per rank per step (sim only)")
    ap.add_argument("--corpus", choices=sorted(CORPORA), default="photos",
                    help="photos: the default corpus; documents: pages and screenshots under "
                         "a ~2 MP rule (sim only; its own max pixels unless --max-pixels)")
    ap.add_argument("--no-swaps", action="store_true",
                    help="plan without the swaps between ranks after each image step "
                         "(`plan/swaps.py`), for comparison")
    args = ap.parse_args(argv)
    if args.no_swaps:
        from streamload.plan import planner
        planner.SWAPS = False
    corpus_pixels = CORPORA[args.corpus][1]
    if (args.capacity != C or args.max_pixels is not None) and not args.no_loader:
        ap.error("--capacity and --max-pixels change the simulation only: add --no-loader")
    if args.max_pixels is None:
        args.max_pixels = corpus_pixels
    extra = {k: v for k, v in (("lookahead", args.lookahead),
                               ("max_images_per_row", args.max_images_per_row),
                               ("max_patches_per_row", args.max_patches_per_row)) if v}
    C, MAX_PIXELS, M = args.capacity, args.max_pixels, args.micro_batches
    results, corpora = [], {}
    modes = ("hybrid", "backbone")
    for R in [int(x) for x in args.sim_ranks.split(",") if x]:
        mean_fused = make_corpus(2000, args.seed, args.corpus).fused.mean()
        n = int(args.sim_steps * R * M * C / mean_fused)
        corpus = make_corpus(n, args.seed, args.corpus)
        corpora[f"sim_R{R}"] = shares(corpus)
        base = token_baseline(corpus, R, args.seed)
        results.append(row("token_baseline", "sim", R, base, None))
        print_row(results[-1])
        energon = energon_baseline(corpus, R, args.seed, args.packing_buffer)
        results.append(row("energon_ffd", "sim", R, energon, base))
        print_row(results[-1])
        for mode in modes:
            started = time.process_time()
            res = simulate(corpus, R, mode, args.seed, **extra)
            res["cpu_s"] = round(time.process_time() - started, 1)
            results.append(row(mode, "sim", R, res, base, energon))
            print_row(results[-1])
    if not args.no_loader:
        corpus = make_corpus(args.loader_samples, args.seed + 7, args.corpus)
        name = "" if args.corpus == "photos" else f"_{args.corpus}"
        root = Path(args.workdir) / f"n{args.loader_samples}_s{args.seed + 7}{name}"
        if not (root / "done").exists():
            write_tars(root, corpus)
            (root / "done").write_text("ok")
        corpora["loader"] = shares(corpus)
        for R in [int(x) for x in args.loader_ranks.split(",") if x]:
            base = token_baseline(corpus, R, args.seed)
            results.append(row("token_baseline", "loader", R, base, None))
            print_row(results[-1])
            energon = energon_baseline(corpus, R, args.seed, args.packing_buffer)
            results.append(row("energon_ffd", "loader", R, energon, base))
            print_row(results[-1])
            for mode in modes:
                started = time.perf_counter()
                res = loader_run(root, corpus, R, mode, args.seed, not args.no_swaps)
                res["wall_s"] = round(time.perf_counter() - started, 1)
                results.append(row(mode, "loader", R, res, base, energon))
                print_row(results[-1])
    print(json.dumps({"corpora": corpora, "results": results,
                      "cost": {"cost_a": COST_A, "cost_b": COST_B, "encoder_cost_a": ENC_A,
                               "encoder_cost_b": ENC_B}, "C": C, "M": M, "options": extra,
                      "packing_buffer": args.packing_buffer, "corpus": args.corpus,
                      "swaps": not args.no_swaps,
                      "max_pixels": MAX_PIXELS}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
