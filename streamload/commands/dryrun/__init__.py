"""`streamload plan CONFIG.toml --steps N`: dry-run a configuration's plan without training.

It reads only lengths, then runs the loader's step loop on them: the mixture's quotas
(`QuotaMixer`), the planner (`Planner`) and the head windows, with no tokens, no buffers and no
process group. What it prints is what a job with that configuration would get: the realized mix
per step against the target, and the predicted cost balance across ranks.

    scans = scan(spec, max_docs=None)                 # per source: item lengths (I/O, once)
    lengths = scan_lengths(spec, max_docs=None)       # the same, just the arrays
    reports = simulate(spec, scans, steps=100, ranks=8)   # pure NumPy
    summary = summarize(spec, reports)

Reading lengths
    Token shards (`.tokens.npy`): the lengths come straight from each shard's `.offsets.npy`
    index (np.diff(offsets)); the token arrays are never read. JSONL: a fast length scan that
    decodes the records and measures each text with the configured tokenizer (UTF-8 bytes
    without one, like the loader). `max_docs` caps the documents read per source (a scan only
    reads as far as it needs); a source cut short this way is *sampled* (see below).
    Documents longer than `micro_batch_tokens` (C) become items exactly as the loader makes them
    (`long_documents`: split into chunks of C, the last shorter; truncate; drop), and empty
    documents are left out.

The simulated loop (the loader's `Runtime._step_loop`, on lengths)
    * Each source's items are dealt to R ranks like the loader deals them: the seeded
      permutation of its shards, strided by rank (`state.fresh_layout`), records in order. A
      sampled source deals its items round-robin over ranks instead and repeats them when a
      rank's share runs out, standing for a source much larger than the sample; plain arrays
      given to `simulate` are dealt round-robin too.
    * Every (rank, source) has a FIFO head window of `window_tokens` tokens, sized by
      `plan_memory` as the loader sizes it (about window_factor x share x M x C + C): the shortest
      prefix holding that many tokens, or everything left in the epoch.
    * Every step: the windows become `Candidates`; `QuotaMixer.quota` sets the quotas,
      `Planner.assign` selects and places items, `QuotaMixer.update` carries the deficits. Taken
      items leave their windows; the rest stay in order and age by one step.
    * When sources run out, `QuotaMixer.outcome` decides: the others go on, the epoch ends (the
      carried deficits reset, shards are dealt again, up to `epochs`), or a `stop` source ends
      the run. A `restart` source never runs out: each rank goes on with its share of the next
      pass (the deal rotated, `state.deal`), across epochs, as the loader does.
    Fetching is assumed to keep up (every window is full when the step is planned), so the dry
    run shows the plan, not I/O stalls.
"""
from .report import DEFAULT_STEPS, format_summary, format_table, run, summarize
from .scan import SourceScan, scan, scan_lengths
from .simulate import DEFAULT_RANKS, StepReport, simulate

__all__ = ["DEFAULT_RANKS", "DEFAULT_STEPS", "SourceScan", "StepReport", "format_summary",
           "format_table", "run", "scan", "scan_lengths", "simulate", "summarize"]
