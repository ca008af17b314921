"""`streamload inspect URI`: a source's shards, record counts and document-length histogram.

It reads the source with the loader's own code: `formats.catalog` picks the shards (and leaves
out companion files; objects of no known format are listed, with what to do about them), and
each shard's format measures its documents (`document_lengths`, as the dry run does): JSONL
records are decoded and measured in UTF-8 bytes (the loader's default tokenizer); pre-tokenized
shards are measured from their offsets index alone, in token ids (the token arrays are not
read, so a bad token file or negative ids do not show here). Bad records are counted and
shown, not raised.
"""
from __future__ import annotations

import asyncio
import math
import typing
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..config import FormatName, Source
from ..formats import LENGTHS_CHUNK_BYTES, Problems
from ..formats.catalog import LeftOut, Shard, catalog
from ..storage import ObjectStore, open_store


@dataclass
class ShardReport:
    name: str
    size: int
    records: int = 0
    tokens: int = 0
    skipped_records: int = 0
    error: Optional[str] = None       # the shard could not be read at all


@dataclass
class SourceReport:
    uri: str
    format: str
    shards: list[ShardReport] = field(default_factory=list)
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    shards_total: int = 0             # listed; `shards` may hold fewer with max_shards
    problems: list[str] = field(default_factory=list)
    left_out: list[LeftOut] = field(default_factory=list)   # objects of no known format

    @property
    def records(self) -> int:
        return sum(s.records for s in self.shards)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def to_dict(self, capacity: int) -> dict:
        lengths = self.lengths
        return {
            "uri": self.uri, "format": self.format, "shards_listed": self.shards_total,
            "shards_read": len(self.shards),
            "shards": [{"name": s.name, "size": s.size, "records": s.records, "tokens": s.tokens,
                        "skipped_records": s.skipped_records, "error": s.error}
                       for s in self.shards],
            "bytes": sum(s.size for s in self.shards),
            "records": self.records, "tokens": self.tokens,
            "skipped_records": sum(s.skipped_records for s in self.shards),
            "empty_records": int((lengths == 0).sum()),
            "longer_than_capacity": int((lengths > capacity).sum()), "capacity": capacity,
            "length": _quantiles(lengths), "histogram": histogram(lengths),
            "problems": self.problems,
            "left_out": [{"name": o.name, "hint": o.hint} for o in self.left_out],
        }


def _quantiles(lengths: np.ndarray) -> dict:
    if not lengths.size:
        return {}
    q = np.percentile(lengths, [50, 90, 99])
    return {"min": int(lengths.min()), "mean": float(lengths.mean()), "p50": float(q[0]),
            "p90": float(q[1]), "p99": float(q[2]), "max": int(lengths.max())}


def histogram(lengths: np.ndarray) -> list[dict]:
    """Counts in power-of-two bins [lo, hi); empty documents get a bin of their own."""
    out = []
    if not lengths.size:
        return out
    empty = int((lengths == 0).sum())
    if empty:
        out.append({"lo": 0, "hi": 1, "count": empty})
    positive = lengths[lengths > 0]
    if positive.size:
        exps = np.floor(np.log2(positive)).astype(int)
        for e in range(int(exps.min()), int(exps.max()) + 1):
            out.append({"lo": 2 ** e, "hi": 2 ** (e + 1), "count": int((exps == e).sum())})
    return out


async def _read_shard(store: ObjectStore, source: Source, shard: Shard, chunk_bytes: int,
                      report: ShardReport, problems: list[str]) -> np.ndarray:
    skips = Problems(source.name or "source", shard.name, "skip")
    lengths, _ = await shard.format.document_lengths(store, shard.info, problems=skips,
                                                     chunk_bytes=chunk_bytes)
    for record, reason in skips.take():
        if record is None:
            report.error = reason
        else:
            report.skipped_records += 1
        if len(problems) < 20:
            where = f"{shard.name}" + (f" record {record}" if record is not None else "")
            problems.append(f"{where}: {reason}")
    report.records = int(lengths.size)
    report.tokens = int(lengths.sum())
    return lengths


async def inspect_source(uri: str, *, format: Optional[str] = None, text_field: Optional[str] = None,
                         tokens_field: Optional[str] = None,
                         storage_options: Optional[dict] = None, max_shards: Optional[int] = None,
                         chunk_bytes: int = LENGTHS_CHUNK_BYTES, concurrency: int = 8
                         ) -> SourceReport:
    """Read every shard of `uri` (the first `max_shards` only, if given) and measure it."""
    source = Source(uri, format=format, text_field=text_field, tokens_field=tokens_field)
    store = open_store(uri, storage_options or None)
    try:
        listed = await catalog(source, store)
        shards = listed.shards
        chosen = shards if max_shards is None else shards[:max_shards]
        formats = sorted({s.format.name for s in shards})
        report = SourceReport(uri, "+".join(formats), shards_total=len(shards),
                              left_out=listed.left_out)
        report.shards = [ShardReport(s.name, s.info.size) for s in chosen]
        slots = asyncio.Semaphore(concurrency)

        async def one(shard: Shard, shard_report: ShardReport) -> np.ndarray:
            async with slots:
                try:
                    return await _read_shard(store, source, shard, chunk_bytes, shard_report,
                                             report.problems)
                except Exception as exc:   # an unreadable shard is reported, not fatal
                    shard_report.error = f"{type(exc).__name__}: {exc}"
                    report.problems.append(f"{shard.name}: {shard_report.error}")
                    return np.zeros(0, np.int64)

        per_shard = await asyncio.gather(*(one(s, r) for s, r in zip(chosen, report.shards)))
        report.lengths = np.concatenate([np.zeros(0, np.int64), *per_shard])
        return report
    finally:
        await store.aclose()


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def format_report(report: SourceReport, capacity: int, width: int = 40,
                  shard_lines: int = 20) -> str:
    d = report.to_dict(capacity)
    lines = [f"source {report.uri}",
             f"  format {d['format']}, {d['shards_listed']} shard(s)"
             + (f", {d['shards_read']} read" if d["shards_read"] != d["shards_listed"] else "")
             + f", {_human_bytes(d['bytes'])}, {d['records']:,} records, {d['tokens']:,} tokens"]
    if report.left_out:
        lines.append(f"  {len(report.left_out)} object(s) left out, of no format this source "
                     f"reads:")
        for o in report.left_out[:shard_lines]:
            lines.append(f"    {o.name}: {o.hint}")
        if len(report.left_out) > shard_lines:
            lines.append(f"    ... {len(report.left_out) - shard_lines} more")
    lines.append("")
    name_width = min(60, max([5] + [len(s.name) for s in report.shards]))
    lines.append(f"  {'shard':<{name_width}} {'size':>10} {'records':>9} {'tokens':>12}")
    shown = report.shards if len(report.shards) <= shard_lines else \
        report.shards[:shard_lines // 2] + [None] + report.shards[-(shard_lines // 2):]
    for s in shown:
        if s is None:
            lines.append(f"  ... {len(report.shards) - 2 * (shard_lines // 2)} more")
            continue
        note = f"  ({s.skipped_records} bad)" if s.skipped_records else ""
        note += f"  UNREADABLE: {s.error}" if s.error and not s.records else ""
        lines.append(f"  {s.name:<{name_width}} {_human_bytes(s.size):>10} {s.records:>9,} "
                     f"{s.tokens:>12,}{note}")
    lines.append("")
    q = d["length"]
    if q:
        unit = "token ids" if d["format"] == "tokens" else "tokens = UTF-8 bytes"
        lines.append(f"  document length ({unit}): min {q['min']:,}, "
                     f"mean {q['mean']:,.0f}, p50 {q['p50']:,.0f}, p90 {q['p90']:,.0f}, "
                     f"p99 {q['p99']:,.0f}, max {q['max']:,}")
        lines.append(f"  longer than C={capacity}: {d['longer_than_capacity']:,} "
                     f"(split into chunks by default); empty: {d['empty_records']:,}")
        bins = d["histogram"]
        top = max(b["count"] for b in bins)
        total = max(1, sum(b["count"] for b in bins))
        for b in bins:
            label = "0" if b["hi"] == 1 and b["lo"] == 0 else f"{b['lo']:,}-{b['hi'] - 1:,}"
            bar = "#" * (math.ceil(width * b["count"] / top) if b["count"] else 0)
            lines.append(f"  {label:>15} {b['count']:>8,} {b['count'] / total:>6.1%} {bar}")
    else:
        lines.append("  no records")
    if d["skipped_records"] or report.problems:
        lines.append("")
        lines.append(f"  problems ({d['skipped_records']} bad record(s)):")
        lines += [f"    {p}" for p in report.problems[:20]]
    return "\n".join(lines)


def parse_storage_options(pairs: list[str], endpoint_url: Optional[str]) -> dict:
    """["k=v", ...] -> {k: v}; values "true"/"false" become booleans."""
    options: dict = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option expects KEY=VALUE, got {pair!r}")
        options[key] = {"true": True, "false": False}.get(value.lower(), value)
    if endpoint_url:
        options["endpoint_url"] = endpoint_url
    return options


def add_arguments(p) -> None:
    p.add_argument("uri", help="a prefix, directory, glob or single shard (local, file://, s3://)")
    p.add_argument("--format", choices=list(typing.get_args(FormatName)), default=None,
                   help="shard format (default: from the file names)")
    p.add_argument("--text-field", default=None,
                   help="field (or tar member extension) holding the text (default: the format's, "
                        "text; txt for tars)")
    p.add_argument("--tokens-field", default=None, help="field holding token ids instead of text")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option for the store, e.g. region_name=eu-west-1 (repeatable)")
    p.add_argument("--endpoint-url", default=None,
                   help="S3 endpoint (default: $AWS_ENDPOINT_URL, else AWS)")
    p.add_argument("--max-shards", type=int, default=None,
                   help="read only the first N shards (all are listed)")
    p.add_argument("--capacity", type=int, default=4096, metavar="C",
                   help="count documents longer than this row capacity (default 4096)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args) -> int:
    import json
    import sys

    from ..errors import StreamloadError

    try:
        options = parse_storage_options(args.storage_option, args.endpoint_url)
        if options and ("://" not in args.uri or args.uri.startswith("file://")):
            raise ValueError("--storage-option and --endpoint-url are for remote URIs only")
        report = asyncio.run(inspect_source(
            args.uri, format=args.format, text_field=args.text_field,
            tokens_field=args.tokens_field, storage_options=options,
            max_shards=args.max_shards))
    except (StreamloadError, ValueError, OSError) as exc:
        print(f"streamload inspect: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.to_dict(args.capacity)))
    else:
        print(format_report(report, args.capacity))
    return 0 if not any(s.error for s in report.shards) else 1


if __name__ == "__main__":   # pragma: no cover
    import argparse
    parser = argparse.ArgumentParser(prog="streamload inspect")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
