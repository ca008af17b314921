"""The one home of retries, backoff and per-request timeouts for every store.

Stores disable their client's own retries (botocore's included) so that a request is attempted
exactly as the RetryPolicy says, and counted once, here.
"""
from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec

from streamload.errors import ConfigError, StorageError
from streamload.storage.base import StoreCounters

T = TypeVar("T")


class RetryPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """How often and how patiently a store retries one request."""

    max_attempts: int = 8
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 5.0
    request_timeout_s: float = 60.0   # per attempt, not per call
    jitter: bool = True               # "full jitter": spreads out retries of many clients

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError.at("max_attempts", f"must be >= 1, got {self.max_attempts}",
                                 where="retry.")
        for name in ("initial_backoff_s", "max_backoff_s", "request_timeout_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError.at(name, f"must be >= 0, got {getattr(self, name)}",
                                     where="retry.")
        if self.request_timeout_s == 0:
            raise ConfigError.at("request_timeout_s", "must be > 0", where="retry.")

    def backoff_s(self, retry_index: int) -> float:
        """Delay before retry number `retry_index` (0-based): exponential, capped, jittered."""
        cap = min(self.max_backoff_s, self.initial_backoff_s * 2.0 ** retry_index)
        return random.uniform(0.0, cap) if self.jitter else cap


def describe(exc: BaseException) -> str:
    """A one-line account of an error for messages. Exception texts from botocore, aiohttp and
    fsspec carry codes, URLs and paths, never credentials."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def _attempt(op: Callable[[], Awaitable[T]], timeout_s: float) -> T:
    """`op()` under a timeout. Not `asyncio.wait_for`: on Python 3.11 it returns the result,
    swallowing the cancellation, when the caller is cancelled just as `op` completes. A fetch
    that swallowed its cancellation went on to wait for memory that a closing loader never
    frees, and close() hung (seen in benchmarks/throughput.py, reproduced by the close test)."""
    if hasattr(asyncio, "timeout"):   # 3.11+: cancellation-safe
        async with asyncio.timeout(timeout_s):
            return await op()
    return await asyncio.wait_for(op(), timeout_s)   # pragma: no cover - Python 3.10


async def with_retries(
    op: Callable[[], Awaitable[T]],
    *,
    policy: RetryPolicy,
    what: str,
    counters: StoreCounters,
    is_retryable: Callable[[BaseException], bool],
) -> T:
    """Await `op()` until it succeeds, retrying transient failures with backoff.

    `what` is the URI the request is about; it names the object when attempts run out. Errors
    that are not retryable propagate unchanged, for the store to translate. A StorageError from
    `op` is final. An attempt that exceeds policy.request_timeout_s counts as transient.
    """
    last: BaseException | None = None
    for attempt in range(policy.max_attempts):
        if attempt:
            counters.retries += 1
            await asyncio.sleep(policy.backoff_s(attempt - 1))
        try:
            return await _attempt(op, policy.request_timeout_s)
        except StorageError:
            raise
        except asyncio.TimeoutError as exc:  # our per-attempt timeout, or the client's own
            last = exc
        except Exception as exc:
            if not is_retryable(exc):
                raise
            last = exc
    attempts = "1 attempt" if policy.max_attempts == 1 else f"{policy.max_attempts} attempts"
    cause = describe(last)
    if isinstance(last, asyncio.TimeoutError) and not str(last):
        cause = f"no response within {policy.request_timeout_s:g} s"
    raise StorageError(f"{what}: gave up after {attempts}; last error: {cause}",
                       uri=what) from last
