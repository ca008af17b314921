"""S3 through aiobotocore: one pooled client per store, bounded concurrency, ranged GETs."""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any, TypeVar

import aiohttp
from aiobotocore.session import AioSession
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    CredentialRetrievalError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ProfileNotFound,
    SSOTokenLoadError,
    TokenRetrievalError,
    UnauthorizedSSOTokenError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.loaders import create_loader

from streamload.errors import ConfigError, StorageError, did_you_mean
from streamload.storage.base import ObjectInfo, StoreCounters
from streamload.storage.listing import glob_regex, has_glob, literal_prefix, scheme_of
from streamload.storage.retry import RetryPolicy, describe, with_retries

T = TypeVar("T")

# Codes that mean "slow down" or "try again", whatever their HTTP status.
_RETRYABLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
    "TooManyRequestsException", "RequestThrottled", "RequestThrottledException",
    "InternalError", "ServiceUnavailable", "RequestTimeout", "RequestTimeoutException",
    "PriorRequestNotComplete", "503",
})
_CREDENTIAL_CODES = frozenset({
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
    "TokenRefreshRequired",
})

# storage_options keys -> create_client arguments (s3fs-style aliases accepted).
_CLIENT_OPTIONS = {
    "endpoint_url": "endpoint_url",
    "region_name": "region_name", "region": "region_name",
    "aws_access_key_id": "aws_access_key_id", "key": "aws_access_key_id",
    "aws_secret_access_key": "aws_secret_access_key", "secret": "aws_secret_access_key",
    "aws_session_token": "aws_session_token", "token": "aws_session_token",
}
_OTHER_OPTIONS = ("profile", "anon")
_SECRET_OPTIONS = ("aws_access_key_id", "key", "aws_secret_access_key", "secret",
                   "aws_session_token", "token")   # not passed on when anon=True

# Errors finding or loading credentials, before any request is sent.
_CREDENTIAL_ERRORS = (NoCredentialsError, PartialCredentialsError, ProfileNotFound,
                      CredentialRetrievalError, SSOTokenLoadError, TokenRetrievalError,
                      UnauthorizedSSOTokenError)

# How to give credentials, another endpoint or anonymous access: the end of every credential
# or permission error. Names of options and variables only, never values.
_GIVE_CREDENTIALS = (
    'give credentials in storage_options={"key": ..., "secret": ...} (add "token" for '
    'temporary ones) or {"profile": ...}, or in the environment: AWS_ACCESS_KEY_ID and '
    'AWS_SECRET_ACCESS_KEY, or AWS_PROFILE')
_OTHER_ENDPOINT = ('another endpoint: storage_options={"endpoint_url": ...} or '
                   'AWS_ENDPOINT_URL_S3')
_CREDENTIALS_HELP = (f"To fix: {_GIVE_CREDENTIALS}; {_OTHER_ENDPOINT}; a public bucket: "
                     f'storage_options={{"anon": True}} (unsigned requests).')

# Where botocore found the credentials it signs with (Credentials.method): never the keys.
_CREDENTIAL_METHODS = {
    "env": "the environment (AWS_ACCESS_KEY_ID)",
    "shared-credentials-file": "the shared credentials file (AWS_SHARED_CREDENTIALS_FILE, "
                               "~/.aws/credentials)",
    "config-file": "the AWS config file (AWS_CONFIG_FILE, ~/.aws/config)",
    "iam-role": "the instance's IAM role",
    "container-role": "the container's role",
    "assume-role": "an assumed role (AWS config)",
    "sso": "AWS SSO",
}

# Botocore's service models, parsed once per process rather than once per store's session
# (about 0.1 s each). The loader only reads bundled JSON files: nothing loop- or user-specific.
_SHARED_LOADER = create_loader()


class _TruncatedBody(Exception):
    """The body was shorter than the server said: a dropped connection, so worth a retry."""


def split_s3_uri(uri: str) -> tuple[str, str]:
    """"s3://bucket/some/key" -> ("bucket", "some/key")."""
    bucket, _, key = uri[len("s3://"):].partition("/")
    if scheme_of(uri) != "s3" or not bucket:
        raise ConfigError(f"not an S3 URI (expected s3://bucket/key): {uri!r}")
    return bucket, key


def _error_code(exc: ClientError) -> tuple[str, int]:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return code, status


def is_retryable(exc: BaseException) -> bool:
    """Throttling, 5xx and connection faults are transient; other S3 errors are final."""
    if isinstance(exc, ClientError):
        code, status = _error_code(exc)
        return code in _RETRYABLE_CODES or status >= 500 or status == 429
    return isinstance(exc, (
        _TruncatedBody, BotoConnectionError, HTTPClientError, IncompleteReadError,
        aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, ConnectionError,
    ))


class _Access:
    """What a credential or permission error says about the request: never the keys."""

    def __init__(self, endpoint: str, anon: bool, credentials: str | None):
        self.endpoint, self.anon, self.credentials = endpoint, anon, credentials

    def describe(self) -> str:
        """' Endpoint: http://.... Credentials: from the environment (AWS_ACCESS_KEY_ID).'"""
        text = f" Endpoint: {self.endpoint}."
        if self.credentials:
            text += f" Credentials: from {self.credentials}."
        return text


def _is_access_problem(exc: BaseException) -> bool:
    if isinstance(exc, _CREDENTIAL_ERRORS):
        return True
    if isinstance(exc, ClientError):
        code, status = _error_code(exc)
        return code in _CREDENTIAL_CODES or code in ("AccessDenied", "AllAccessDisabled") \
            or status == 403
    return False


def _storage_error(exc: Exception, uri: str, bucket: str,
                   access: _Access | None = None) -> StorageError:
    """A final error, said in terms of the bucket and URI the user wrote; a credential or
    permission error also names the endpoint, where the credentials came from (never what
    they are) and how to give others."""
    where = access.describe() if access is not None else ""
    if isinstance(exc, _CREDENTIAL_ERRORS):
        problem = f"no S3 credentials found for {uri}" if isinstance(exc, NoCredentialsError) \
            else f"cannot load S3 credentials for {uri}: {describe(exc)}"
        return StorageError(f"{problem}.{where} {_CREDENTIALS_HELP}", uri=uri)
    if not isinstance(exc, ClientError):
        return StorageError(f"{uri}: {describe(exc)}", uri=uri)
    code, status = _error_code(exc)
    if code == "NoSuchBucket":
        message = f"bucket {bucket!r} does not exist ({uri})"
    elif code in ("NoSuchKey", "NotFound") or status == 404:
        return StorageError(f"no such object: {uri}", uri=uri, missing=True)
    elif code in _CREDENTIAL_CODES:
        message = f"S3 rejected the credentials used for {uri} ({code}).{where} " \
                  f"{_CREDENTIALS_HELP}"
    elif code in ("AccessDenied", "AllAccessDisabled") or status == 403:
        if access is not None and access.anon:
            message = (f"access denied to {uri} for an anonymous request (storage_options "
                       f'"anon": True).{where} To fix: the bucket must allow public reads, or '
                       f'drop "anon" and {_GIVE_CREDENTIALS}; {_OTHER_ENDPOINT}.')
        else:
            message = (f"access denied to {uri} ({code or status}).{where} Check the "
                       f"credentials and the bucket policy. {_CREDENTIALS_HELP}")
    else:
        detail = exc.response.get("Error", {}).get("Message", "")
        message = f"{uri}: S3 error {code or status}" + (f": {detail}" if detail else "")
    return StorageError(message, uri=uri)


def _range_length(resp: dict[str, Any], start: int, end: int) -> int | None:
    """How many bytes of [start, end) a ranged GetObject response carries (ranges past the end
    of the object come back short, as from a file); None when the server ignored Range and
    sent the whole object."""
    content_range = resp.get("ContentRange")  # "bytes 0-99/1000"
    if not content_range:
        return None
    size = content_range.rsplit("/", 1)[-1]
    total = int(size) if size.isdigit() else end  # "*": size unknown, expect the full range
    return max(0, min(end, total) - start)


def _body_range(resp: dict[str, Any], data: bytes, start: int, end: int) -> bytes:
    """Bytes [start, end) out of a GetObject response, or _TruncatedBody if some are missing."""
    expected = _range_length(resp, start, end)
    if expected is None:   # the whole object
        total = int(resp.get("ContentLength", len(data)))
        data = data[start:end]
        expected = max(0, min(end, total) - start)
    if len(data) < expected:
        raise _TruncatedBody(f"received {len(data)} of {expected} bytes")
    return data[:expected]


async def _body_into(resp: dict[str, Any], body: Any, start: int, end: int,
                     buffer: Callable[[int], Any]) -> Any:
    """The range's bytes written into `buffer(length)`, piece by piece as aiohttp received
    them: no ~1 MiB `bytes` joined from the pieces (`StreamReader.read` does that)."""
    expected = _range_length(resp, start, end)
    content = getattr(body.raw_stream, "content", None)   # aiohttp's StreamReader
    if expected is None or content is None:   # the whole object, or not aiohttp: copy it
        data = _body_range(resp, await body.read(), start, end)
        out = buffer(len(data))
        memoryview(out)[:] = data
        return out
    out = buffer(expected)
    at = 0
    with memoryview(out) as view:
        while at < expected:
            piece, end_of_chunk = await content.readchunk()
            if not piece:
                if end_of_chunk:   # the end of an HTTP chunk (chunked encoding), not of the body
                    continue
                break
            take = min(len(piece), expected - at)   # a longer body: the range is its start
            view[at:at + take] = piece if take == len(piece) else piece[:take]
            at += take
    if at < expected:
        raise _TruncatedBody(f"received {at} of {expected} bytes")
    return out


class S3Store:
    """ObjectStore for s3:// URIs. Create it anywhere; its client is made inside the event loop
    on first use, and lives until aclose()."""

    list_page_size = 1000  # keys per list_objects_v2 request (S3's maximum)

    def __init__(self, storage_options: dict[str, Any] | None = None, *,
                 retry: RetryPolicy | None = None, max_concurrency: int = 16):
        if max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {max_concurrency}")
        options = dict(storage_options or {})
        allowed = sorted((*_CLIENT_OPTIONS, *_OTHER_OPTIONS))
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            hint = did_you_mean(unknown[0], allowed)
            raise ConfigError(f"unknown S3 storage_options {unknown}{hint} (allowed: "
                              f"{', '.join(allowed)})", key=unknown[0])
        anon = options.get("anon", False)
        if not isinstance(anon, bool):
            raise ConfigError(f"S3 storage_options anon: must be True or False, got {anon!r}",
                              key="anon")
        # anon=True wins over keys (a public source beside the loader's shared credentials):
        # its requests are unsigned, and the keys never leave this store.
        self._anon = anon
        self.counters = StoreCounters()
        self.retry = retry or RetryPolicy()
        self.max_concurrency = max_concurrency
        # Credentials stay in this private dict: never in a repr, a message or saved state.
        self._client_kwargs: dict[str, Any] = {
            _CLIENT_OPTIONS[k]: v for k, v in options.items() if k in _CLIENT_OPTIONS
            and not (anon and k in _SECRET_OPTIONS)}
        self._client_kwargs.setdefault("endpoint_url", os.environ.get("AWS_ENDPOINT_URL_S3")
                                       or os.environ.get("AWS_ENDPOINT_URL") or None)
        self._client_kwargs.setdefault("region_name", os.environ.get("AWS_DEFAULT_REGION")
                                       or os.environ.get("AWS_REGION") or "us-east-1")
        self._profile = None if anon else options.get("profile")
        timeout = self.retry.request_timeout_s
        self._config = Config(
            max_pool_connections=max_concurrency,
            retries={"total_max_attempts": 1, "mode": "standard"},  # RetryPolicy retries instead
            connect_timeout=min(10.0, timeout),
            read_timeout=timeout,
            signature_version=UNSIGNED if anon else None,
        )
        self._slots = asyncio.Semaphore(max_concurrency)
        self._client_lock = asyncio.Lock()
        self._client: Any = None
        self._session: AioSession | None = None
        self._exit_stack: AsyncExitStack | None = None

    async def __aenter__(self) -> S3Store:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _get_client(self) -> Any:
        async with self._client_lock:
            if self._client is None:
                stack = AsyncExitStack()
                session = AioSession(profile=self._profile)
                session.register_component("data_loader", _SHARED_LOADER)
                try:
                    self._client = await stack.enter_async_context(
                        session.create_client("s3", config=self._config, **self._client_kwargs))
                except ValueError as exc:   # botocore's "Invalid endpoint: ..."
                    raise ConfigError(f"S3 storage_options endpoint_url: {exc} (expected "
                                      f"http(s)://host[:port])", key="endpoint_url") from None
                self._session, self._exit_stack = session, stack
        return self._client

    def _endpoint(self) -> str:
        if self._client is not None:
            return str(self._client.meta.endpoint_url)
        return self._client_kwargs.get("endpoint_url") or \
            f"AWS S3 in {self._client_kwargs.get('region_name')}"

    async def _access(self, exc: BaseException) -> _Access:
        """For an error about credentials or permissions: the endpoint, and where the
        credentials came from (botocore's record of it, never the keys)."""
        source = None
        if self._anon:   # unsigned: no credentials are used
            pass
        elif "aws_access_key_id" in self._client_kwargs:
            source = "storage_options"
        elif isinstance(exc, ClientError) and self._session is not None:
            try:   # the session's credentials, resolved when the client was made (cached)
                credentials = await self._session.get_credentials()
            except Exception:   # noqa: BLE001 - a better message is not worth a new failure
                credentials = None
            method = getattr(credentials, "method", None)
            if method:
                source = _CREDENTIAL_METHODS.get(method, f"the AWS credential chain ({method})")
            if self._profile and source:
                source += f", profile {self._profile!r}"
        return _Access(self._endpoint(), self._anon, source)

    async def aclose(self) -> None:
        async with self._client_lock:
            stack, self._exit_stack, self._client = self._exit_stack, None, None
            self._session = None
            if stack is not None:
                await stack.aclose()

    async def _call(self, uri: str, bucket: str, op: Callable[[Any], Awaitable[T]],
                    counters: StoreCounters | None = None) -> T:
        """One request under the concurrency bound, retried, with final errors translated."""
        try:
            client = self._client or await self._get_client()
            # The slot is held across retries, so backing off also lowers our request rate.
            async with self._slots:
                return await with_retries(lambda: op(client), policy=self.retry, what=uri,
                                          counters=counters or self.counters,
                                          is_retryable=is_retryable)
        except (ClientError, BotoCoreError) as exc:
            access = await self._access(exc) if _is_access_problem(exc) else None
            raise _storage_error(exc, uri, bucket, access) from exc

    async def read_range(self, uri: str, start: int, end: int, *,
                         counters: StoreCounters | None = None,
                         buffer: Callable[[int], Any] | None = None) -> Any:
        if not 0 <= start <= end:
            raise ValueError(f"bad byte range [{start}, {end}) for {uri}")
        bucket, key = split_s3_uri(uri)
        if start == end:
            return b""
        counters = counters or self.counters

        async def get(client: Any) -> Any:
            began = time.perf_counter()
            counters.requests += 1
            try:
                resp = await client.get_object(Bucket=bucket, Key=key,
                                               Range=f"bytes={start}-{end - 1}")
            except ClientError as exc:
                if _error_code(exc)[0] == "InvalidRange":  # start is at or past the end
                    return b""
                raise
            async with resp["Body"] as body:
                data = _body_range(resp, await body.read(), start, end) if buffer is None \
                    else await _body_into(resp, body, start, end, buffer)
            counters.record_latency(time.perf_counter() - began)
            counters.bytes_read += len(data)
            return data

        return await self._call(uri, bucket, get, counters)

    async def _list_page(self, uri: str, bucket: str, prefix: str, token: str | None = None,
                         max_keys: int | None = None) -> dict[str, Any]:
        args: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix,
                                "MaxKeys": max_keys or self.list_page_size}
        if token:
            args["ContinuationToken"] = token

        async def list_page(client: Any) -> dict[str, Any]:
            self.counters.requests += 1
            return await client.list_objects_v2(**args)

        return await self._call(uri, bucket, list_page)

    async def _list_prefix(self, uri: str, bucket: str, prefix: str) -> list[ObjectInfo]:
        found, token = [], None
        while True:
            page = await self._list_page(uri, bucket, prefix, token)
            for item in page.get("Contents", ()):
                if item["Key"].endswith("/") and item["Size"] == 0:
                    continue  # a "directory" marker that consoles create, not data
                found.append(ObjectInfo(f"s3://{bucket}/{item['Key']}", int(item["Size"])))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return found

    async def list(self, uri: str) -> list[ObjectInfo]:
        bucket, key = split_s3_uri(uri)
        if has_glob(key):
            pattern = glob_regex(key)
            found = [info for info in await self._list_prefix(uri, bucket, literal_prefix(key))
                     if pattern.fullmatch(info.uri[len(f"s3://{bucket}/"):])]
        elif not key or key.endswith("/"):
            found = await self._list_prefix(uri, bucket, key)
        else:
            # Keys list in byte order, so an object named exactly `key` comes first.
            first = (await self._list_page(uri, bucket, key, max_keys=1)).get("Contents", [])
            if first and first[0]["Key"] == key:
                return [ObjectInfo(uri, int(first[0]["Size"]))]
            found = await self._list_prefix(uri, bucket, key + "/") if first else []
            if first and not found:  # not a "directory": a raw key prefix ("logs/2024-")
                found = await self._list_prefix(uri, bucket, key)
        if not found:
            raise StorageError(f"no objects match {uri}", uri=uri)
        return sorted(found)
