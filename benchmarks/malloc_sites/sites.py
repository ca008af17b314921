"""Read what malloc_sites.c wrote for one process: the sites (C frames, resolved with addr2line)
that allocated blocks of >= 100 KiB, per thread, by bytes: count, mean size, how many glibc
served with a mapping of its own, mean lifetime, how many another thread freed; then the
mapped blocks whose free raised glibc's dynamic mmap threshold (each free of a mapped block
larger than the threshold raises it to that size, and the trim threshold to twice that).

    python benchmarks/malloc_sites/sites.py /tmp/ms/12345 [--frames 7] [--top 25]
"""
from __future__ import annotations

import argparse
import bisect
import collections
import os
import struct
import subprocess

RECORD = struct.Struct("<dii3Q10Q")   # time, thread, op (0 free, 1 malloc, 2 calloc, 3 realloc),
                                      # pointer, size, chunk header, 10 return addresses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prefix", help="MTRACE_DIR/<pid> (without .bin / .maps)")
    ap.add_argument("--frames", type=int, default=7)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    raw = open(args.prefix + ".bin", "rb").read()
    recs = [RECORD.unpack_from(raw, i) for i in range(0, len(raw) - RECORD.size + 1, RECORD.size)]
    spans, base = [], {}
    for line in open(args.prefix + ".maps"):
        parts = line.split()
        if len(parts) < 6:
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        base.setdefault(parts[5], lo - int(parts[2], 16))
        if "x" in parts[1]:
            spans.append((lo, hi, parts[5]))
    spans.sort()
    starts = [s[0] for s in spans]

    def where(addr):
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and spans[i][0] <= addr < spans[i][1]:
            return spans[i][2], addr - base[spans[i][2]]
        return None, addr

    wanted = collections.defaultdict(set)
    for r in recs:
        for a in r[6:]:
            module, offset = where(a - 1) if a else (None, 0)
            if module:
                wanted[module].add(offset)
    names = {}
    for module, offsets in wanted.items():
        offsets = sorted(offsets)
        out = subprocess.run(["addr2line", "-f", "-e", module, *map(hex, offsets)],
                             capture_output=True, text=True).stdout.split("\n")
        for i, offset in enumerate(offsets):
            names[module, offset] = f"{os.path.basename(module)}:{out[2 * i] if 2 * i < len(out) else '?'}"

    def frames(r):
        out = []
        for a in r[6:]:
            module, offset = where(a - 1) if a else (None, 0)
            name = names.get((module, offset), hex(a))
            if not name.startswith(("malloc_sites", "mtrace")):   # the interposer itself
                out.append(name)
        return tuple(out[:args.frames])

    t0 = recs[0][0] if recs else 0.0
    live, stats, raises, threshold = {}, {}, [], 128 * 1024
    for t, tid, op, ptr, size, header, *_ in recs:
        if op:
            key = (tid, frames((t, tid, op, ptr, size, header, *_)))
            s = stats.setdefault(key, [0, 0, 0, 0.0, 0])
            s[0] += 1
            s[1] += size
            s[2] += bool(header & 2)
            live[ptr] = (key, t, tid, size, header)
            continue
        found = live.pop(ptr, None)
        if found:
            key, born, owner, size, header = found
            stats[key][3] += t - born
            stats[key][4] += tid != owner
            if header & 2 and size > threshold:
                threshold = size
                raises.append((t - t0, size, owner, key[1]))
    print("threads (records):", collections.Counter(r[1] for r in recs).most_common())
    for key, (n, total, mapped, life, elsewhere) in sorted(stats.items(),
                                                          key=lambda kv: -kv[1][1])[:args.top]:
        print(f"thread {key[0]}: {n} blocks, mean {total / n / 1024:.0f} KiB, "
              f"{total / 2**20:.0f} MiB in all, {mapped} mapped, mean life "
              f"{life / n * 1e3:.1f} ms, {elsewhere} freed by another thread\n    " +
              "\n    ".join(key[1]))
    print("\nfrees that raised the mmap threshold (seconds from the first record, size):")
    for t, size, owner, where_ in raises:
        print(f"  {t:.2f} s  {size} bytes  thread {owner}  {' < '.join(where_[:4])}")


if __name__ == "__main__":
    main()
