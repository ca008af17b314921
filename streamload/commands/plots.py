"""PNG plots of a run (a metrics log, `streamload report`) and of a dry run (`streamload plan`).

    plot_run(read_metrics("metrics.jsonl"), "run.png", target_shares={"web": 0.7, "code": 0.3})
    plot_plan(summary, reports, "plan.png")

Both draw the same six panels on one 1200 x 900 figure (12 x 9 inches at 100 dpi):

    mix per step          each source's share of the step (its tokens, or items with a
                          mixture by samples), smoothed over a few steps, against the target
                          (dashed) when it is known
    mix over the run      the cumulative share since the first step, against the target: how
                          fast the realized mix converges
    fill and tokens       fill (job tokens / R*M*C) per step; the right axis reads it in tokens
                          per step (the same line: the job's tokens are fill x R*M*C), and
                          this rank's tokens when they differ
    balance               imbalance (max / mean predicted rank cost) per step; the max and mean
                          rank cost on the right axis
    deferral              histogram of each step's longest deferral (steps a taken sample waited)
    exchange              tokens (or bytes) exchanged between ranks per step, when the log has
                          them (`exchanged_tokens` / `exchanged_bytes`); else a note

matplotlib is optional (`pip install streamload[plot]`); it is imported when a plot is drawn,
through its Agg canvas only (no pyplot: nothing global changes in the caller's process).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

__all__ = ["plot_run", "plot_plan", "FIGSIZE", "DPI"]

FIGSIZE = (12.0, 9.0)   # inches
DPI = 100               # -> 1200 x 900 pixels
HEADROOM = 1.18         # y range over the data's: a band at the top for the legend
EXCHANGE_KEYS = ("exchanged_tokens", "exchanged_bytes", "exchange_tokens", "exchange_bytes")


@dataclass
class _Series:
    """What the panels draw, per step (N steps, S sources)."""
    steps: np.ndarray                  # [N]
    names: list[str]                   # [S]
    units: np.ndarray                  # [N, S]: each source's tokens (or items) this step
    unit: str                          # "tokens" or "samples"
    target: Optional[np.ndarray]       # [N, S] target shares, or None when unknown
    fill: Optional[np.ndarray]         # [N]
    tokens: np.ndarray                 # [N] tokens per step (the job's)
    rank_tokens: Optional[np.ndarray]  # [N] this rank's (a run's log), None for a plan
    imbalance: np.ndarray              # [N]
    cost_max: np.ndarray               # [N]
    cost_mean: np.ndarray              # [N]
    deferral: np.ndarray               # [N] the longest deferral of each step
    exchanged: Optional[np.ndarray]    # [N] or None
    exchanged_label: str = ""
    title: str = ""


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise ImportError(f"plotting needs matplotlib: pip install streamload[plot] ({exc})") \
            from exc
    return Figure, FigureCanvasAgg, MaxNLocator


# -- from a metrics log ---------------------------------------------------------------------------
def _source_names(records: Sequence[Mapping], prefix: str) -> list[str]:
    names: dict[str, None] = {}
    for record in records:
        for key in record:
            if key.startswith(prefix):
                names.setdefault(key[len(prefix):], None)
    return list(names)


def _column(records: Sequence[Mapping], key: str, default: float = np.nan) -> np.ndarray:
    return np.array([float(r.get(key, default)) for r in records], dtype=np.float64)


def _has(records: Sequence[Mapping], key: str) -> bool:
    return any(key in r for r in records)


def series_from_records(records: Sequence[Mapping], target_shares: Optional[Mapping] = None,
                        by: str = "tokens") -> _Series:
    """The panels' data from step records (`observe.step_record`, a metrics log). Target
    shares: `target_shares` (normalized over the sources named), else the log's own
    `target/<source>` keys when it has them, else unknown."""
    records = list(records)
    unit = "samples" if by == "samples" else "tokens"
    prefix = unit
    if unit == "tokens" and _source_names(records, "job_tokens/"):
        prefix = "job_tokens"   # the job's mix, where the log has it, not this rank's part
    names = _source_names(records, f"{prefix}/")
    if target_shares:
        names += [n for n in target_shares if n not in names]
    N, S = len(records), len(names)
    units = np.zeros((N, S))
    for s, name in enumerate(names):
        units[:, s] = np.nan_to_num(_column(records, f"{prefix}/{name}", 0.0))
    target = None
    if target_shares:
        weights = np.array([float(target_shares.get(n, 0.0)) for n in names])
        if weights.sum() > 0:
            target = np.tile(weights / weights.sum(), (N, 1))
    elif names and any(_has(records, f"target/{n}") for n in names):
        target = np.stack([_column(records, f"target/{n}") for n in names], axis=1)
    steps = _column(records, "step") if _has(records, "step") else np.arange(N, dtype=float)
    tokens = _column(records, "job_tokens" if _has(records, "job_tokens") else "tokens")
    exchanged, label = None, ""
    for key in EXCHANGE_KEYS:
        if _has(records, key):
            exchanged, label = _column(records, key), key.replace("_", " ")
            break
    return _Series(
        steps=steps, names=names, units=units, unit=unit, target=target,
        fill=_column(records, "fill") if _has(records, "fill") else None,
        tokens=tokens,
        rank_tokens=(_column(records, "tokens") if _has(records, "job_tokens")
                     and _has(records, "tokens") else None),
        imbalance=_column(records, "imbalance"),
        cost_max=_column(records, "rank_cost_max"), cost_mean=_column(records, "rank_cost_mean"),
        deferral=_column(records, "max_deferral", 0.0), exchanged=exchanged,
        exchanged_label=label)


def plot_run(records: Sequence[Mapping], path: str | os.PathLike, *,
             target_shares: Optional[Mapping[str, float]] = None, by: str = "tokens",
             title: Optional[str] = None) -> str:
    """Draw a run's metrics log (records of `observe.step_record`, e.g. `read_metrics(path)`)
    into a 1200 x 900 PNG at `path`; see the module docstring for the panels. `by`: the
    mixture's unit ("tokens" or "samples"), the share the mix panels draw. Returns the path."""
    series = series_from_records(records, target_shares, by)
    series.title = title if title is not None else f"run: {len(series.steps)} steps"
    return _draw(series, path)


# -- from a dry run -------------------------------------------------------------------------------
def series_from_plan(summary: Mapping, reports: Sequence) -> _Series:
    """The panels' data from the dry run (`summarize`'s dict, its `StepReport`s)."""
    reports = list(reports)
    names = list(summary.get("sources", {}))
    if reports and len(names) != len(reports[0].share):
        names = [f"source {s}" for s in range(len(reports[0].share))]
    S = len(names)
    unit = "samples" if summary.get("by") == "samples" else "tokens"

    def stack(field, width) -> np.ndarray:
        return np.array([np.asarray(getattr(r, field), dtype=np.float64) for r in reports]
                        ).reshape(len(reports), width)

    units = stack("samples" if unit == "samples" else "tokens", S)
    cost = [np.asarray(r.rank_cost, dtype=np.float64) for r in reports]
    return _Series(
        steps=np.array([r.step for r in reports], dtype=np.float64), names=names, units=units,
        unit=unit, target=stack("target_share", S) if reports else None,
        fill=np.array([r.fill for r in reports], dtype=np.float64),
        tokens=np.array([float(np.sum(r.rank_tokens)) for r in reports]), rank_tokens=None,
        imbalance=np.array([r.imbalance for r in reports], dtype=np.float64),
        cost_max=np.array([c.max() if c.size else 0.0 for c in cost]),
        cost_mean=np.array([c.mean() if c.size else 0.0 for c in cost]),
        deferral=np.array([r.max_age for r in reports], dtype=np.float64), exchanged=None)


def plot_plan(summary: Mapping, reports: Sequence, path: str | os.PathLike, *,
              title: Optional[str] = None) -> str:
    """Draw the dry run (`streamload plan`'s summary and per-step `StepReport`s) into a
    1200 x 900 PNG at `path`, with the run's panels (module docstring); the dry run moves no
    tokens, so the exchange panel holds a note. Returns the path."""
    series = series_from_plan(summary, reports)
    if title is None:
        where = summary.get("config")
        ranks = summary.get("ranks")
        title = (f"plan{f' {os.path.basename(str(where))}' if where else ''}: "
                 f"{len(series.steps)} steps" + (f", R={ranks}" if ranks else ""))
    series.title = title
    series.exchanged_label = "the dry run moves no tokens"
    return _draw(series, path)


# -- drawing --------------------------------------------------------------------------------------
def _smooth_window(n: int) -> int:
    return int(min(50, max(1, n // 20)))


def _trailing_sum(values: np.ndarray, window: int) -> np.ndarray:
    """Sum over the last `window` rows (fewer at the start), along axis 0."""
    c = np.cumsum(values, axis=0)
    out = c.copy()
    if window < values.shape[0]:
        out[window:] = c[window:] - c[:-window]
    return out


def _shares(units: np.ndarray) -> np.ndarray:
    total = units.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, units / np.where(total > 0, total, 1.0), np.nan)


def _top(values: np.ndarray) -> float:
    """The largest finite value (0 when none)."""
    finite = values[np.isfinite(values)]
    return float(finite.max()) if finite.size else 0.0


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _draw(series: _Series, path: str | os.PathLike) -> str:
    fig = _figure(series)
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    return path


def _fill_panel(ax, series: _Series) -> None:
    """Fill per step on the left axis. The job's tokens per step are fill x R*M*C, so they are
    not drawn again (a second line would lie exactly on the fill line and hide it): the right
    axis is the same scale in tokens. Without fill, the tokens are drawn."""
    x = series.steps
    ax.set_title("fill and tokens per step")
    ax.set_xlabel("step")
    right = ax.twinx()
    handles = []
    capacity = None
    if series.fill is not None:
        handles += ax.plot(x, series.fill, color="C0", lw=1.2, label="fill (tokens, job)")
        ax.set_ylim(0, HEADROOM * max(1.0, _top(series.fill)))
        ax.set_ylabel("fill (of R*M*C)")
        ok = np.isfinite(series.fill) & np.isfinite(series.tokens) & (series.fill > 0)
        if ok.any():
            capacity = float(np.median(series.tokens[ok] / series.fill[ok]))
    if capacity:
        right.set_ylim(0, ax.get_ylim()[1] * capacity)
    else:
        handles += right.plot(x, series.tokens, color="C1", lw=1.0, alpha=0.8,
                              label="tokens (job)")
        right.set_ylim(0, HEADROOM * max(_top(series.tokens), 1.0))
    if series.rank_tokens is not None and not np.array_equal(series.rank_tokens, series.tokens):
        handles += right.plot(x, series.rank_tokens, color="C2", lw=1.0, alpha=0.8,
                              label="tokens (this rank)")
    right.set_ylabel("tokens per step")
    ax.legend(handles=handles, loc="upper center", fontsize="small", ncol=3, frameon=False)


def _figure(series: _Series):
    """The six panels (module docstring) on one Figure."""
    Figure, FigureCanvasAgg, MaxNLocator = _matplotlib()
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 2)
    fig.suptitle(series.title)
    x = series.steps
    N, S = series.units.shape
    colors = [f"C{s % 10}" for s in range(S)]
    empty = N == 0

    # Mix per step (smoothed) and over the run, against the target.
    window = _smooth_window(N)
    for ax, cumulative in ((axes[0, 0], False), (axes[0, 1], True)):
        if empty or not S:
            _note(ax, "no steps" if empty else "no sources in the log")
            continue
        units = np.cumsum(series.units, axis=0) if cumulative else \
            _trailing_sum(series.units, window)
        share = _shares(units)
        for s, name in enumerate(series.names):
            ax.plot(x, share[:, s], color=colors[s], label=name, lw=1.3)
            if series.target is not None:
                target = series.target[:, s]
                if cumulative:   # the target of the run so far, weighted like the shares
                    weights = series.units.sum(axis=1)
                    wsum = np.cumsum(weights)
                    with np.errstate(invalid="ignore", divide="ignore"):
                        target = np.where(wsum > 0, np.cumsum(np.nan_to_num(target) * weights)
                                          / np.where(wsum > 0, wsum, 1.0), target)
                ax.plot(x, target, color=colors[s], ls="--", lw=1.0, alpha=0.8)
        ax.set_ylim(0, HEADROOM)   # the legend's band above 1
        ax.set_yticks(np.linspace(0, 1, 6))
        ax.set_ylabel(f"share of {series.unit}")
        ax.set_xlabel("step")
        if cumulative:
            ax.set_title("mix over the run (cumulative)" + (", target dashed"
                                                           if series.target is not None else ""))
        else:
            ax.set_title(f"mix per step (over {window} step{'s' if window > 1 else ''})"
                         + (", target dashed" if series.target is not None else ""))
            ax.legend(loc="upper center", fontsize="small", ncol=min(S, 5), frameon=False)

    # Fill and tokens per step.
    if empty:
        _note(axes[1, 0], "no steps")
    else:
        _fill_panel(axes[1, 0], series)

    # Balance: imbalance and rank cost.
    ax = axes[1, 1]
    if empty:
        _note(ax, "no steps")
    else:
        ax.set_title("balance: imbalance (max/mean rank cost) and rank cost")
        ax.set_xlabel("step")
        handles = ax.plot(x, series.imbalance, color="C3", lw=1.2, label="imbalance")
        ax.set_ylabel("imbalance")
        spread = max(_top(series.imbalance) - 1.0, 0.01)   # from 1.0 (perfect) up
        ax.set_ylim(1.0 - 0.05 * spread, 1.0 + spread * (1 + 2 * (HEADROOM - 1)))
        right = ax.twinx()
        handles += right.plot(x, series.cost_max, color="C4", lw=1.0, alpha=0.8,
                              label="rank cost max")
        handles += right.plot(x, series.cost_mean, color="C5", lw=1.0, alpha=0.8, ls=":",
                              label="rank cost mean")
        right.set_ylabel("predicted rank cost")
        right.set_ylim(0, HEADROOM * max(_top(series.cost_max), 1e-12))
        ax.legend(handles=handles, loc="upper center", fontsize="small", ncol=3,
                  frameon=False)

    # Deferral histogram.
    ax = axes[2, 0]
    if empty:
        _note(ax, "no steps")
    else:
        deferral = np.nan_to_num(series.deferral).astype(np.int64)
        top = int(deferral.max(initial=0))
        ax.hist(deferral, bins=np.arange(top + 2) - 0.5, color="C0", rwidth=0.85)
        ax.set_title("deferral: the longest wait of each step")
        ax.set_xlabel("steps the longest-waiting sample was deferred")
        ax.set_ylabel("steps")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        if top < 20:
            ax.set_xticks(range(top + 1))

    # Exchange.
    ax = axes[2, 1]
    if empty or series.exchanged is None:
        _note(ax, "no steps" if empty else
              (series.exchanged_label or "no exchange recorded in the log"))
        ax.set_title("exchanged between ranks per step")
    else:
        ax.plot(x, series.exchanged, color="C6", lw=1.0)
        ax.set_title(f"{series.exchanged_label} per step")
        ax.set_xlabel("step")
        ax.set_ylabel(series.exchanged_label.split(" ", 1)[-1])
        ax.set_ylim(0, HEADROOM * max(_top(series.exchanged), 1.0))
    return fig
