"""on_error="skip" with a limit: one ledger per source on each rank counts what was skipped, and
stops a source that skips too much, which is a misconfigured source, not bad records.

A skip of `on_error="skip"` is a counted loss; a source whose every record is skipped (a
misspelt `text_field`) would otherwise train on nothing and say nothing. So the fetcher hands
every skip (a record, or the rest of a shard) and every kept record to its `SkipLedger`, which

* counts them in the source's metrics (`skipped_records`, `skipped_shards`, `skip_reasons`,
  `first_skip`), and
* raises a DataError naming the source, the counts and the first error when
  - the first `SKIP_LIMIT_RECORDS` records the rank read of the source were all skipped, or
  - more than `max_skip_fraction` of its records were skipped, once it has read
    `SKIP_LIMIT_RECORDS`, or
  - at the end of an epoch, every record it read was skipped, or every shard it read was
    skipped without a record kept.

The counts are this rank's (each rank reads its own shards), so a DataError comes from the rank
that saw the skips and the job fails as for any other DataError. `max_skip_fraction=1.0` turns
the limit off (every skip is still counted).
"""
from __future__ import annotations

from typing import Optional

from ..errors import DataError
from ..metrics import SourceMetrics

SKIP_LIMIT_RECORDS = 100   # records a rank reads of a source before a share of skips is judged


class SkipLedger:
    def __init__(self, source: str, uri: str, max_fraction: float, metrics: SourceMetrics):
        self.source, self.uri, self.max_fraction, self.metrics = source, uri, max_fraction, metrics
        self.kept = 0   # records read and kept
        self.skipped_records = self.skipped_shards = 0   # this ledger's (the metrics sum them)

    def add(self, shard: str, skips: list[tuple[Optional[int], str]], kept: int) -> None:
        """Count `skips` of `shard` ((record or None for the rest of the shard, reason)) and
        `kept` records kept; raises when the source went past the limit."""
        m = self.metrics
        for record, reason in skips:
            if record is None:
                m.skipped_shards += 1
                self.skipped_shards += 1
            else:
                m.skipped_records += 1
                self.skipped_records += 1
            where = f"{self.source}/{shard}" + (f"/{record}" if record is not None else "")
            m.skip_reasons.append(f"{where}: {reason}")
            if m.first_skip is None:
                m.first_skip = f"shard {shard!r}" + (f", record {record}" if record is not None
                                                     else "") + f": {reason}"
        self.kept += kept
        if skips:
            self.check(final=False)

    def check(self, final: bool) -> None:
        """Raise a DataError when the source skipped past the limit; `final`: at the end of an
        epoch, when fewer than SKIP_LIMIT_RECORDS records may be all there is."""
        if self.max_fraction >= 1.0:
            return
        skipped, shards = self.skipped_records, self.skipped_shards
        read = skipped + self.kept
        if self.kept == 0 and (skipped >= SKIP_LIMIT_RECORDS or (final and skipped)):
            problem = (f"skipped all of the first {skipped} record(s) it read" if not final
                       else f"skipped every one of the {skipped} record(s) it read")
        elif read >= SKIP_LIMIT_RECORDS and skipped > self.max_fraction * read:
            problem = (f"skipped {skipped} of the {read} records it read, more than "
                       f"max_skip_fraction={self.max_fraction:g}")
        elif final and self.kept == 0 and shards and shards >= self.metrics.shards_read:
            problem = f"skipped every one of the {shards} shard(s) it read"
        else:
            return
        raise DataError(
            f"on_error='skip' {problem} (this rank; {skipped} record(s) and {shards} shard(s) "
            f"skipped in all). The first error: {self.metrics.first_skip}. A source that "
            f"skips this much is misconfigured (a text_field or format that does not fit "
            f"{self.uri}), not holding a few bad records; set max_skip_fraction=1.0 to accept "
            f"it", source=self.source)
