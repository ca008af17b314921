"""Image-text samples: which decoder, and streamload's decode throughput and memory next to
Megatron-Energon reading the same WebDataset in the same run.

    python benchmarks/multimodal.py            # 240 samples (~1,000 JPEGs), 2 workers
    python benchmarks/multimodal.py --quick    # 60 samples, smoke run
    python benchmarks/multimodal.py --corpus /tmp/mm --reps 3   # keep the corpus; 3 runs each

Corpus (generated once per run, seeded, in a temporary folder): --samples image-text samples in
4 WebDataset tars, 0-8 JPEGs per sample (uniform), each of a resolution drawn from 320x240 up to
1920x1080 and portrait or panorama shapes, with photo-like content (smooth colour fields, edges,
grain) saved at quality 90; captions of 5 to 2,000 words (log-uniform). Energon's index
(`.nv-meta`, `.tar.idx`) is prepared beside the tars by Energon itself (not timed).

Decoders (this process, one core, CPU time by `time.process_time`): every JPEG of the first
tar decoded to RGB and resized to its Qwen2-VL placement (`vision.qwen2_vl()`: dynamic, at most
1024 x 28² pixels) by
  * pillow:        Image.open, convert("RGB"), resize bicubic;
  * simplejpeg:    simplejpeg.decode_jpeg(min_height, min_width) (libjpeg-turbo, scaled
                   decode), then Pillow's bicubic resize;
  * streamload (vision.decode): what the loader runs, `vision.decode.decode_rgb`;
  (PyTurboJPEG needs a system libturbojpeg, absent here: listed as not run.)
and the header probe that the fetcher runs per image on the trainer's process
(`vision.probe`). Images/s and encoded MB/s per core; mean absolute difference of each
decoder's pixels from pillow's.

Loaders (each in a fresh child process, one epoch over all 4 tars, --workers worker
processes): streamload's Loader (Qwen2-VL geometry, one 32768-token row per step, one step
prefetched: about as much decoded data in flight as Energon's workers hold; planner default;
decode in worker processes: decode, resize, patchify, plus reading, tokenizing UTF-8,
planning and packing) and Energon's (get_train_dataset over a CrudeWebdataset, its
SampleDecoder "torchrgb8" decoding every image to uint8 in its worker processes; batch 1; no
resize: it decodes at full size, which a trainer then resizes, so it is the lower bound of an
Energon pipeline's work), and Energon doing the same work as streamload ("energon+resize": its
decoder gives PIL images, its task encoder resizes them bicubic to the same Qwen2-VL placement
in its workers, as a Qwen2-VL task encoder calling the processor does). Measured: CPU seconds of the process and all its children (getrusage
of the process and of its ended children, plus psutil for the live ones, at the epoch's end),
wall seconds, and the peak of the process tree's summed PSS (sampled every 50 ms; PSS splits
shared pages, such as forked workers' copy-on-write ones, between their processes). Per core: images and
encoded MB per CPU second. Both include their start (importing torch, starting workers),
which a longer run amortizes: compare at the default size or larger.

The machine is shared and loaded: CPU time, not wall time, is the measure.
With --reps, each loader runs that many times, alternating, and the run of median CPU is
reported (with every run's CPU and peak). Prints a table on stderr and a JSON last line on
stdout.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

# streamload's configurations: the default planner, whose lookahead window buffers W = 8 steps
# of samples (their encoded images) ahead; and "balanced" over 1 step of window, buffering about
# what a loader without planning holds.
STREAMLOAD_CONFIGS = {"streamload": {},
                      "streamload (balanced, window 1)": {"planner": "balanced",
                                                          "window_factor": 1.0}}
SIZES = [(320, 240), (640, 480), (800, 600), (1024, 768), (1280, 720), (1920, 1080),
         (512, 512), (480, 640), (600, 1400), (1600, 400)]
TARS = 4


# ---------------------------------------------------------------------------- the corpus

def photo(width: int, height: int, rng: np.random.Generator) -> bytes:
    """A photo-like JPEG: smooth colour fields, a few hard edges, grain; quality 90."""
    from PIL import Image
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    image = np.zeros((height, width, 3), np.float32)
    for c in range(3):
        fx, fy, phase = rng.uniform(0.5, 4, 2).tolist() + [rng.uniform(0, 6.28)]
        image[..., c] = 128 + 80 * np.sin(x / width * fx * 3.14 + phase) \
            * np.cos(y / height * fy * 3.14)
    for _ in range(4):   # rectangles: edges
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        image[y0:y0 + height // 4, x0:x0 + width // 5] = rng.uniform(0, 255, 3)
    image += rng.normal(0, 6, image.shape)
    out = io.BytesIO()
    Image.fromarray(np.clip(image, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def caption(rng: np.random.Generator, images: int) -> str:
    words = int(math.exp(rng.uniform(math.log(5), math.log(2000))))
    text = " ".join(f"w{int(k)}" for k in rng.integers(0, 5000, words))
    return text if images == 0 or rng.random() < 0.5 else \
        " ".join(["<image>"] * images) + " " + text


def write_corpus(root: Path, samples: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    images = encoded = 0
    per_tar = math.ceil(samples / TARS)
    for t in range(TARS):
        with tarfile.open(root / f"part-{t:03d}.tar", "w") as tar:
            for s in range(t * per_tar, min(samples, (t + 1) * per_tar)):
                n = int(rng.integers(0, 9))
                members = [(f"{s:06d}.txt", caption(rng, n).encode())]
                for k in range(n):
                    w, h = SIZES[int(rng.integers(0, len(SIZES)))]
                    members.append((f"{s:06d}.{k}.jpg", photo(w, h, rng)))
                    images += 1
                    encoded += len(members[-1][1])
                for name, data in members:
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return {"samples": samples, "images": images, "encoded_mb": encoded / 1e6}


def prepare_energon(root: Path) -> None:
    from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator
    names = sorted(p.name for p in root.glob("*.tar"))
    WebdatasetPreparator.prepare_dataset(root, names, split_parts_ratio=[("train", 1.0)],
                                         shuffle_seed=None, workers=1,
                                         progress_fn=lambda it, total=None: it)
    (root / ".nv-meta" / "dataset.yaml").write_text(
        "__module__: megatron.energon\n__class__: CrudeWebdataset\n")


# ---------------------------------------------------------------------------- decoders

def jpegs_of(path: Path) -> list[bytes]:
    with tarfile.open(path) as tar:
        return [tar.extractfile(m).read() for m in tar.getmembers() if m.name.endswith(".jpg")]


def decoders(jpegs: list[bytes]) -> list[dict]:
    from PIL import Image
    from streamload.vision import qwen2_vl
    from streamload.vision.decode import decode_rgb
    from streamload.vision.probe import probe
    rule = qwen2_vl()
    targets = []
    for data in jpegs:
        header = probe(data)
        placed = rule.place(header.height, header.width)
        targets.append((placed.height, placed.width))

    def pillow(data, h, w):
        image = Image.open(io.BytesIO(data)).convert("RGB")
        return np.asarray(image.resize((w, h), Image.Resampling.BICUBIC))

    def simple(data, h, w):
        import simplejpeg
        pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=h, min_width=w)
        image = Image.fromarray(pixels)
        if image.size != (w, h):
            image = image.resize((w, h), Image.Resampling.BICUBIC)
        return np.asarray(image)

    methods = {"pillow": pillow, "simplejpeg": simple,
               "streamload (vision.decode)": decode_rgb}
    mb = sum(map(len, jpegs)) / 1e6
    out, reference = [], None
    for name, fn in methods.items():
        try:
            fn(jpegs[0], *targets[0])
        except ImportError as exc:
            out.append({"decoder": name, "skipped": str(exc)})
            continue
        started = time.process_time()
        results = [fn(d, h, w) for d, (h, w) in zip(jpegs, targets)]
        cpu = time.process_time() - started
        if reference is None:
            reference = results
        diff = float(np.mean([np.abs(a.astype(np.int16) - b).mean()
                              for a, b in zip(results, reference)]))
        out.append({"decoder": name, "images_per_core_s": len(jpegs) / cpu,
                    "mb_per_core_s": mb / cpu, "cpu_s": cpu, "mean_abs_diff": diff})
    started = time.process_time()
    for data in jpegs:
        probe(data)
    cpu = time.process_time() - started
    out.append({"decoder": "probe (header only)", "images_per_core_s": len(jpegs) / cpu,
                "mb_per_core_s": mb / cpu, "cpu_s": cpu})
    out.append({"decoder": "pyturbojpeg", "skipped": "needs a system libturbojpeg (absent)"})
    return out


# ---------------------------------------------------------------------------- loaders (children)

def tree_cpu() -> float:
    """CPU seconds of this process, its children that ended (and were waited for: a
    DataLoader's workers at the end of its epoch) and its live ones (a process pool's)."""
    import psutil
    cpu = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        cpu += usage.ru_utime + usage.ru_stime
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
            cpu += t.user + t.system
        except psutil.Error:
            pass
    return cpu


class PeakMemory:
    """The largest proportional set size (PSS: shared pages split between the processes that
    share them) of this process and its children together, sampled every 50 ms."""

    def __init__(self):
        import threading
        self.peak_mb, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil
        me = psutil.Process()
        while not self._stop.wait(0.05):
            total = 0
            for p in [me] + me.children(recursive=True):
                try:
                    total += p.memory_full_info().pss
                except psutil.Error:
                    pass
            self.peak_mb = max(self.peak_mb, total / 2 ** 20)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_mb


def run_streamload(root: str, workers: int, options: dict) -> dict:
    import streamload as sl
    from streamload.vision import qwen2_vl
    memory = PeakMemory()
    started = time.perf_counter()
    images = patches = 0
    options = {"micro_batch_tokens": 32768, "micro_batches": 1, "prefetch_steps": 1,
               "epochs": 1, "image_workers": workers, "decode_images_in": "processes",
               **options}
    loader = sl.Loader([sl.Source(root, images=qwen2_vl())], **options)
    for batch in loader:
        for mb in batch.micro_batches:
            images += mb.num_images
            patches += int(mb.pixel_values.shape[0])
    wall = time.perf_counter() - started
    cpu = tree_cpu()
    loader.close()
    return {"images": images, "patches": patches, "cpu_s": cpu, "wall_s": wall,
            "peak_pss_mb": memory.stop()}


def run_energon(root: str, workers: int, resize: bool = False) -> dict:
    import torch
    from megatron.energon import (Cooker, CrudeSample, DefaultTaskEncoder, SampleDecoder,
                                  WorkerConfig, get_loader, get_train_dataset, stateless)
    from PIL import Image
    from streamload.vision import qwen2_vl
    rule = qwen2_vl()

    @stateless
    def cook(sample: CrudeSample) -> dict:
        return sample

    class Encoder(DefaultTaskEncoder):
        # decode only: uint8 tensors at full size; with resize, PIL images resized as a
        # Qwen2-VL processor would (bicubic, to the same placement as streamload's)
        decoder = SampleDecoder(image_decode="pilrgb" if resize else "torchrgb8")
        cookers = [Cooker(cook)]

        def encode_sample(self, sample):
            if resize:
                for key in [k for k in sample if k.endswith(".jpg")]:
                    image = sample[key]
                    placed = rule.place(image.height, image.width)
                    sample[key] = torch.from_numpy(np.asarray(image.resize(
                        (placed.width, placed.height), Image.Resampling.BICUBIC))
                        ).permute(2, 0, 1)
            return sample

        def batch(self, samples):
            return samples

    memory = PeakMemory()
    started = time.perf_counter()
    config = WorkerConfig(rank=0, world_size=1, num_workers=workers)
    dataset = get_train_dataset(root, worker_config=config, batch_size=1,
                                shuffle_buffer_size=None, max_samples_per_sequence=None,
                                task_encoder=Encoder(), repeat=False)
    images = pixels = 0
    for batch in get_loader(dataset):
        for sample in batch:
            for key, value in sample.items():
                if key.endswith(".jpg"):
                    assert isinstance(value, torch.Tensor) and value.dtype == torch.uint8
                    images += 1
                    pixels += value.shape[1] * value.shape[2]
    wall = time.perf_counter() - started
    peak = memory.stop()
    return {"images": images, "pixels": pixels, "cpu_s": tree_cpu(), "wall_s": wall,
            "peak_pss_mb": peak}


def child(which: str, root: str, workers: int) -> None:
    if which.startswith("streamload"):
        result = run_streamload(root, workers, STREAMLOAD_CONFIGS[which])
    else:
        result = run_energon(root, workers, resize=which == "energon+resize")
    print(json.dumps(result))


def run_child(which: str, root: Path, workers: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, __file__, "--child", which, str(root),
                           str(workers)], capture_output=True, text=True, env=env)
    if done.returncode:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- main

def median_run(runs: list[dict]) -> dict:
    """The run of median CPU time, with every run's CPU seconds and peak PSS beside it."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    ok.sort(key=lambda r: r["cpu_s"])
    return {**ok[len(ok) // 2], "runs_cpu_s": [r["cpu_s"] for r in ok],
            "runs_peak_pss_mb": [r["peak_pss_mb"] for r in ok]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--corpus", help="keep the corpus in this folder (made if absent)")
    parser.add_argument("--reps", type=int, default=1,
                        help="runs of each loader, alternating; the median CPU is reported")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], int(args.child[2]))
    samples = 60 if args.quick else args.samples
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.corpus or tmp)
        made = root / ".corpus.json"   # hidden: no source reads it
        if made.exists():
            corpus = json.loads(made.read_text())
        else:
            root.mkdir(parents=True, exist_ok=True)
            corpus = write_corpus(root, samples)
        try:
            if not (root / ".nv-meta" / "dataset.yaml").exists():
                prepare_energon(root)
            energon_ready = True
        except ImportError:
            energon_ready = False
        made.write_text(json.dumps(corpus))
        print(f"corpus: {corpus}", file=sys.stderr)
        direct = decoders(jpegs_of(root / "part-000.tar"))
        for row in direct:
            if "skipped" in row:
                print(f"  {row['decoder']:28s} not run: {row['skipped']}", file=sys.stderr)
            else:
                print(f"  {row['decoder']:28s} {row['images_per_core_s']:8.1f} images/core-s "
                      f"{row['mb_per_core_s']:7.2f} MB/core-s", file=sys.stderr)
        names = list(STREAMLOAD_CONFIGS) + (["energon", "energon+resize"] if energon_ready
                                            else [])
        runs: dict[str, list] = {name: [] for name in names}
        for _ in range(args.reps):   # alternating, so the machine's load falls on all alike
            for name in names:
                runs[name].append(run_child(name, root, args.workers))
        loaders = {name: median_run(r) for name, r in runs.items()}
        if not energon_ready:
            loaders["energon"] = {"error": "megatron-energon is not installed"}
        for name, r in loaders.items():
            if "error" in r:
                print(f"  {name}: failed: {r['error']}", file=sys.stderr)
                continue
            r["images_per_core_s"] = r["images"] / r["cpu_s"]
            r["mb_per_core_s"] = corpus["encoded_mb"] / r["cpu_s"]
            print(f"  {name:32s} {r['images']} images, {r['cpu_s']:.1f} CPU s "
                  f"(runs {', '.join(f'{c:.1f}' for c in r['runs_cpu_s'])}), "
                  f"{r['images_per_core_s']:.1f} images/core-s, {r['mb_per_core_s']:.2f} "
                  f"MB/core-s, peak PSS {r['peak_pss_mb']:.0f} MB, wall {r['wall_s']:.1f} s",
                  file=sys.stderr)
    print(json.dumps({"corpus": corpus, "workers": args.workers, "decoders": direct,
                      "loaders": loaders}))


if __name__ == "__main__":
    main()
