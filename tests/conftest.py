"""Shared fixtures. Real parts wherever possible: S3 is a moto server on 127.0.0.1."""
from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import settings

# --- Hypothesis profiles ------------------------------------------------------------------------
# Loaded here, before the test modules build their own `settings(...)`, which inherit from it.
# "ci" (CI=true): the same examples on every run, so CI fails on a change, never on the draw of
# an old bug; "dev" (make test elsewhere): new random examples each run; "hunt": a long random
# search, with the example counts raised by the files' own variables (README, "Tests").
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.register_profile("hunt", print_blob=True, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE")
                      or ("ci" if os.environ.get("CI", "").lower() == "true" else "dev"))


# --- Timeouts -----------------------------------------------------------------------------------
# A test's timeout (pytest-timeout) only stops a hang: no test relies on it to fail in time.
# Those written in the files were measured on an idle machine; a loaded or shared one (CI) runs
# several times slower, so every one is scaled by STREAMLOAD_TIMEOUT_SCALE (default 3).
TIMEOUT_SCALE = float(os.environ.get("STREAMLOAD_TIMEOUT_SCALE", "3"))


def pytest_collection_modifyitems(config, items):
    for item in items:
        marker = item.get_closest_marker("timeout")
        if marker is not None and marker.args:
            item.add_marker(pytest.mark.timeout(marker.args[0] * TIMEOUT_SCALE, *marker.args[1:],
                                                **marker.kwargs), append=False)


# --- S3 (moto server on loopback) -------------------------------------------------------------

@dataclass(frozen=True)
class S3Server:
    endpoint_url: str


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A moto S3 server on an ephemeral loopback port, with fake credentials in the environment
    for the rest of the session. Nothing can reach a real AWS endpoint: AWS_ENDPOINT_URL points
    here, shared config files are ignored and the instance-metadata lookup is off."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()  # the port the OS bound for port=0
    endpoint_url = f"http://{host}:{port}"
    no_file = str(tmp_path_factory.mktemp("aws") / "absent")
    with pytest.MonkeyPatch.context() as env:
        for name, value in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint_url,
            "AWS_CONFIG_FILE": no_file,
            "AWS_SHARED_CREDENTIALS_FILE": no_file,
            "AWS_EC2_METADATA_DISABLED": "true",
        }.items():
            env.setenv(name, value)
        for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION", "AWS_ENDPOINT_URL_S3"):
            env.delenv(name, raising=False)
        try:
            yield S3Server(endpoint_url)
        finally:
            server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[tuple[object, str]]:
    """(boto3 S3 client, name of a fresh empty bucket); the bucket is deleted afterwards."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server.endpoint_url, region_name="us-east-1")
    bucket = f"test-{uuid.uuid4().hex[:16]}"
    client.create_bucket(Bucket=bucket)
    yield client, bucket
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        if page.get("Contents"):
            client.delete_objects(Bucket=bucket, Delete={
                "Objects": [{"Key": item["Key"]} for item in page["Contents"]]})
    client.delete_bucket(Bucket=bucket)


@pytest.fixture
def storage_options(s3_server: S3Server) -> dict[str, str]:
    """storage_options that point an S3 source at the moto server."""
    return {"endpoint_url": s3_server.endpoint_url}
