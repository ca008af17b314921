"""An embedded S3 server for the demo: moto's ThreadedMotoServer on 127.0.0.1, an ephemeral port.

    with local_s3() as s3:
        s3.upload_dir(local_dir, "s3://demo/web/")
        # in a process the demo spawns, after s3.apply_env() (fake credentials, endpoint):
        Loader([Source("s3://demo/web/")], storage_options={"endpoint_url": s3.endpoint_url})
        # or, in this process: Source("s3://demo/web/", storage_options=s3.storage_options)

Nothing here talks to any address but the loopback server. The fake credentials live in
`s3.env` (for the processes the demo spawns) and `s3.storage_options`; the calling process's
environment is left as it was, except for the moment `client()` builds a boto3 client.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

FAKE_CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
REGION = "us-east-1"
# Variables that could send a client somewhere else, or make it look for real credentials.
_CLEARED = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
            "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI")


class ServerUnavailable(RuntimeError):
    """moto (with its server extra) is not installed."""


@dataclass
class LocalS3:
    endpoint_url: str
    env: dict = field(default_factory=dict)          # set in child processes; None = unset

    @property
    def storage_options(self) -> dict:
        """What an S3 Source needs to read from this server."""
        return {"endpoint_url": self.endpoint_url, "region_name": REGION, **FAKE_CREDENTIALS}

    def apply_env(self) -> None:
        """Point this process at the server (for a child process the demo started)."""
        for name, value in self.env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    def client(self):
        """A boto3 S3 client for this server, built without consulting the user's AWS set-up."""
        import boto3

        with _scoped_env(self.env):
            session = boto3.session.Session(region_name=REGION, **FAKE_CREDENTIALS)
            return session.client("s3", endpoint_url=self.endpoint_url)

    def upload_dir(self, local_dir: str | os.PathLike, uri: str) -> int:
        """Upload every file under `local_dir` to the prefix `uri` ("s3://bucket/prefix/");
        creates the bucket if needed. Returns the number of objects."""
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        client = self.client()
        existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
        if bucket not in existing:
            client.create_bucket(Bucket=bucket)
        count = 0
        root = Path(local_dir)
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            key = prefix + path.relative_to(root).as_posix()
            client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
            count += 1
        return count


@contextlib.contextmanager
def _scoped_env(env: dict) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in env}
    try:
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def require_server() -> None:
    """Raise ServerUnavailable unless moto's server and boto3 can be imported."""
    try:
        import boto3  # noqa: F401
        from moto.server import ThreadedMotoServer  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ServerUnavailable(f"the demo needs moto's S3 server and boto3 ({exc}); "
                                "pip install 'streamload[demo]'") from exc


@contextlib.contextmanager
def local_s3() -> Iterator[LocalS3]:
    """Start moto's S3 server on 127.0.0.1 (port chosen by the OS); stop it on exit."""
    require_server()
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)   # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint_url = f"http://{host}:{port}"
        absent = os.devnull   # no config or credentials files: nothing real gets read
        env = {
            "AWS_ACCESS_KEY_ID": FAKE_CREDENTIALS["aws_access_key_id"],
            "AWS_SECRET_ACCESS_KEY": FAKE_CREDENTIALS["aws_secret_access_key"],
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL": endpoint_url,
            "AWS_CONFIG_FILE": absent,
            "AWS_SHARED_CREDENTIALS_FILE": absent,
            "AWS_EC2_METADATA_DISABLED": "true",
            **{name: None for name in _CLEARED},
        }
        yield LocalS3(endpoint_url, env)
    finally:
        server.stop()
