"""The mix as people asked for it: the target as configured, what was realized while every source
had data, and each epoch with the step each source ran out at.

One account for the three places that report a mix: `Loader.stats()` / `summary()`, `streamload
report` (from a metrics log) and `streamload plan` (the dry run). Each feeds it steps:

    tracker = MixTracker(num_sources)          # on the loop: what the Stepper says of a step
    tracker.begin(stepper, step)               # after Stepper.begin, before commit
    mix = tracker.commit(stepper)              # after Stepper.commit: a StepMix
    tally = MixTally(names)
    tally.add(epoch, units, mix)               # units: [S], the job's, this step
    tally.summary(); format_mix(tally.summary(), "tokens")

Definitions (docs/metrics.md, "The mix"):
- target: the schedule's share of each source as configured (its weights at the step, over
  every source), never renormalized over the sources that still have data, so it does not
  depend on the world size or on when a source runs out;
- the epoch's *tail* begins at the first step at which some source's head windows hold all it
  has left of the epoch (every rank's window is at the end of its share). From there that
  source's last items may be deferred or run short, so its share can no longer be held;
- *all-active* steps: the steps before the tail. The deviation, max |realized - target| over
  the sources, is measured on them. The tail's is reported apart, against the target over the
  sources that still had data (a source that ran out takes no share there);
- a source *ran out at step N*: step N took the last of its items in the epoch (no rank holds
  any more of it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

if TYPE_CHECKING:
    from .plan.stepper import Stepper, Step


@dataclass(frozen=True)
class StepMix:
    """One step's mix facts, beside its units."""
    target: Optional[np.ndarray]   # float [S]: the configured shares at this step; None: unknown
    tail: bool             # the epoch's tail had begun at this step
    ran_out: np.ndarray    # bool [S]: the source ran out with this step


class MixTracker:
    """Turns the Stepper's view of each step into `StepMix`: the configured target, whether the
    tail began, which sources ran out. Driven on every rank (or the dry run) in step order."""

    def __init__(self, num_sources: int):
        self.num_sources = num_sources
        self.epoch: Optional[int] = None
        self.tail = False
        self.out = np.zeros(num_sources, dtype=bool)   # ran out earlier in this epoch
        self.target = np.zeros(num_sources)

    def begin(self, stepper: "Stepper", step: "Step") -> None:
        """After `Stepper.begin` (a "continue" step) and before `commit`: the schedule is at the
        step's position then."""
        if stepper.epoch != self.epoch:   # a new epoch (or the first step after a resume)
            self.epoch, self.tail = stepper.epoch, False
            self.out = ~stepper.holding.any(axis=0)   # no data at all: never "ran out"
        self.target = stepper.mixer.shares_at(np.ones(self.num_sources, dtype=bool))
        exhausted = np.asarray(step.exhausted, dtype=bool).reshape(-1, self.num_sources)
        self.tail = self.tail or bool(exhausted.all(axis=0).any())

    def commit(self, stepper: "Stepper") -> StepMix:
        """After `Stepper.commit`: which sources no rank holds any more of."""
        gone = ~stepper.holding.any(axis=0)
        ran_out = gone & ~self.out
        self.out = self.out | gone
        return StepMix(self.target.copy(), self.tail, ran_out)


@dataclass
class _Part:
    """Units and target-weighted units over a set of steps."""
    steps: int = 0
    units: np.ndarray = None
    wanted: np.ndarray = None

    def add(self, units: np.ndarray, target: Optional[np.ndarray]) -> None:
        if self.units is None:
            self.units, self.wanted = np.zeros(units.size), np.zeros(units.size)
        self.steps += 1
        self.units += units
        if target is not None:
            self.wanted += target * float(units.sum())

    def shares(self) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
        total = 0.0 if self.units is None else float(self.units.sum())
        if total <= 0:
            return None, None
        return self.units / total, self.wanted / total


@dataclass
class MixTally:
    """The run's mix, step by step: over the run, on the all-active steps, in the tails, and
    per epoch (with each source's run-out step). Small: O(epochs x sources)."""
    names: list
    has_target: bool = True
    run: _Part = field(default_factory=_Part)
    active: _Part = field(default_factory=_Part)
    tail: _Part = field(default_factory=_Part)
    epochs: dict = field(default_factory=dict)     # epoch -> _Part
    ran_out: dict = field(default_factory=dict)    # epoch -> {source index: step}

    def add(self, epoch: int, step: int, units: Sequence[float], mix: Optional[StepMix]) -> None:
        """One step: the job's `units` of each source, and its `StepMix` (None: nothing known
        but the units, every step counted as all-active)."""
        units = np.asarray(units, dtype=np.float64).reshape(-1)
        target = None if mix is None or mix.target is None else \
            np.asarray(mix.target, dtype=np.float64)
        if target is None:
            self.has_target = False
        self.run.add(units, target)
        out = self.ran_out.setdefault(int(epoch), {})
        if mix is not None and mix.tail:   # against the target over the sources left
            left = np.ones(units.size, dtype=bool)
            left[list(out)] = False
            if target is not None:
                kept = np.where(left, target, 0.0)
                target = kept / kept.sum() if kept.sum() > 0 else left / max(left.sum(), 1)
            self.tail.add(units, target)
        else:
            self.active.add(units, target)
        self.epochs.setdefault(int(epoch), _Part()).add(units, None)
        if mix is not None:
            for s in np.flatnonzero(mix.ran_out).tolist():
                out.setdefault(s, int(step))

    def summary(self) -> dict:
        """{"steps", "steps_all_active", "steps_tail", "deviation" (max |realized - target| on
        the all-active steps), "tail_deviation", "sources": {name: {"target", "realized",
        "realized_all_active", "target_all_active", "realized_tail", "target_tail" (over the
        sources left), "epochs": [{"epoch", "realized",
        "ran_out_at_step"}]}}}; shares are None where no step counts (and targets where none
        is known)."""
        known = self.has_target

        def listed(values):
            return [None] * len(self.names) if values is None else [float(v) for v in values]

        run, run_target = self.run.shares()
        active, active_target = self.active.shares()
        tail, tail_target = self.tail.shares()
        sources = {}
        for s, name in enumerate(self.names):
            sources[name] = {
                "target": listed(run_target)[s] if known else None,
                "realized": listed(run)[s],
                "realized_all_active": listed(active)[s],
                "target_all_active": listed(active_target)[s] if known else None,
                "realized_tail": listed(tail)[s],
                "target_tail": listed(tail_target)[s] if known else None,
                "epochs": [{"epoch": e, "realized": listed(part.shares()[0])[s],
                            "ran_out_at_step": self.ran_out.get(e, {}).get(s)}
                           for e, part in sorted(self.epochs.items())]}

        def deviation(realized, target):
            if not known or realized is None:
                return None
            return float(np.abs(realized - target).max()) if realized.size else 0.0

        return {"steps": self.run.steps, "steps_all_active": self.active.steps,
                "steps_tail": self.tail.steps, "deviation": deviation(active, active_target),
                "tail_deviation": deviation(tail, tail_target), "sources": sources}


def format_mix(summary: dict, unit: str = "tokens", max_epochs: int = 3) -> list[str]:
    """A mix summary (`MixTally.summary`) as lines: per source the target, the share realized
    while every source had data, then each epoch's (the last `max_epochs`) with its run-out
    step; then the deviation there and in the tails."""
    if not summary.get("steps"):
        return []

    def share(value) -> str:
        return "-" if value is None else f"{value:.3f}"

    active, tail = summary["steps_all_active"], summary["steps_tail"]
    width = max(len(n) for n in summary["sources"]) if summary["sources"] else 0
    lines = [f"mix of {unit}: target (as configured) | realized while every source had data "
             f"({active} step{'s' if active != 1 else ''}) | by epoch"]
    for name, m in summary["sources"].items():
        epochs = m["epochs"][-max_epochs:]
        by_epoch = ", ".join(
            f"epoch {e['epoch']} {share(e['realized'])}"
            + (f" (ran out at step {e['ran_out_at_step']})"
               if e["ran_out_at_step"] is not None else "") for e in epochs)
        more = f"{len(m['epochs']) - len(epochs)} earlier epoch(s), " \
            if len(m["epochs"]) > len(epochs) else ""
        lines.append(f"  {name:<{width}} {share(m['target'])} | "
                     f"{share(m['realized_all_active'])} | {more}{by_epoch}")
    if summary["deviation"] is not None:
        lines.append(f"  max |realized - target| while every source had data: "
                     f"{summary['deviation']:.4f}")
    if tail:
        lines.append(f"  epoch tails ({tail} step{'s' if tail != 1 else ''}, from the step a "
                     f"source's windows held all it had left): "
                     + (f"max |realized - target over the sources left| "
                        f"{summary['tail_deviation']:.4f}"
                        if summary["tail_deviation"] is not None else "no target known"))
    return lines
