"""A moto S3 server for the benchmarks, in its own process, on 127.0.0.1 only.

    with MotoServer(delay_s=0.1) as s3:      # delay_s: also start a slow-first-byte proxy
        s3.upload_dir(local_dir, "bench", "jsonl/web/")
        s3.endpoint_url, s3.delayed_url, s3.env, s3.storage_options

The server runs in a child process so that its CPU time and memory (it holds every object in
memory) are not counted against the loader being measured, and its GIL is its own. The optional
proxy (same child process, its own thread) forwards each request on a fresh upstream connection
after holding it for `delay_s`: about that much added time to first byte per request. It answers
with `Connection: close`, so clients open a new loopback connection per request.

Nothing here talks to any address but 127.0.0.1. The fake credentials are moto's.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

FAKE = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
REGION = "us-east-1"
_CLEARED = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
            "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy")


def client_env(endpoint_url: str) -> dict:
    """Environment for a benchmark child process: fake credentials, the loopback endpoint for
    boto3 (AWS_ENDPOINT_URL) and MosaicML Streaming (S3_ENDPOINT_URL), no proxies, no AWS
    config files. Values of None mean "unset"."""
    absent = "/nonexistent/streamload-bench-aws"
    return {
        "AWS_ACCESS_KEY_ID": FAKE["aws_access_key_id"],
        "AWS_SECRET_ACCESS_KEY": FAKE["aws_secret_access_key"],
        "AWS_DEFAULT_REGION": REGION, "AWS_REGION": REGION,
        "AWS_ENDPOINT_URL": endpoint_url, "S3_ENDPOINT_URL": endpoint_url,
        "AWS_CONFIG_FILE": absent, "AWS_SHARED_CREDENTIALS_FILE": absent,
        "AWS_EC2_METADATA_DISABLED": "true", "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        **{name: None for name in _CLEARED},
    }


def merged_env(extra: dict) -> dict:
    env = dict(os.environ)
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def apply_env(extra: dict) -> None:
    for k, v in extra.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


class MotoServer:
    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.proc = None
        self.endpoint_url = ""
        self.delayed_url = ""

    def __enter__(self) -> "MotoServer":
        env = merged_env(client_env("http://127.0.0.1:1"))
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", str(self.delay_s)],
            stdout=subprocess.PIPE, stdin=subprocess.PIPE, env=env, text=True)
        line = self.proc.stdout.readline().split()
        if len(line) != 2:
            self.proc.kill()
            raise RuntimeError(f"moto server did not start (got {line!r})")
        self.endpoint_url = f"http://127.0.0.1:{line[0]}"
        self.delayed_url = f"http://127.0.0.1:{line[1]}" if line[1] != "0" else ""
        self.env = client_env(self.endpoint_url)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.close()         # the server exits when its stdin closes
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def storage_options(self) -> dict:
        return {"endpoint_url": self.endpoint_url, "region_name": REGION, **FAKE}

    def client(self):
        import boto3
        import botocore.config
        session = boto3.session.Session(region_name=REGION, **FAKE)
        return session.client("s3", endpoint_url=self.endpoint_url,
                              config=botocore.config.Config(max_pool_connections=16))

    def upload_dir(self, local_dir, bucket: str, prefix: str, threads: int = 8) -> tuple[int, int]:
        """Upload every file under local_dir to s3://bucket/prefix...; returns (objects, bytes)."""
        client = self.client()
        existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
        if bucket not in existing:
            client.create_bucket(Bucket=bucket)
        root = Path(local_dir)
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != "DONE")

        def put(path: Path) -> int:
            body = path.read_bytes()
            client.put_object(Bucket=bucket, Key=prefix + path.relative_to(root).as_posix(),
                              Body=body)
            return len(body)

        with ThreadPoolExecutor(threads) as pool:
            sizes = list(pool.map(put, files))
        return len(files), sum(sizes)


# --- the child process -----------------------------------------------------------------------------

def _delaying_proxy(upstream_port: int, delay_s: float) -> int:
    """Start the slow-first-byte proxy in a thread; returns its port."""
    import asyncio

    ready = threading.Event()
    port_box = []

    async def read_request(reader):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = 0
        kept = [lines[0]]
        for line in lines[1:]:
            if not line:
                continue
            name, _, value = line.partition(":")
            lname = name.strip().lower()
            if lname in ("connection", "keep-alive", "proxy-connection"):
                continue
            if lname == "content-length":
                length = int(value.strip())
            kept.append(line)
        kept.append("Connection: close")
        body = await reader.readexactly(length) if length else b""
        return ("\r\n".join(kept) + "\r\n\r\n").encode("latin-1") + body

    async def handle(reader, writer):
        try:
            request = await read_request(reader)
            await asyncio.sleep(delay_s)
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
            up_writer.write(request)
            await up_writer.drain()
            while True:
                data = await up_reader.read(1 << 20)
                if not data:
                    break
                writer.write(data)
                await writer.drain()
            up_writer.close()
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            try:
                writer.close()
            except Exception:
                pass

    def run():
        loop = asyncio.new_event_loop()
        server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0, backlog=256))
        port_box.append(server.sockets[0].getsockname()[1])
        ready.set()
        loop.run_forever()

    threading.Thread(target=run, daemon=True).start()
    ready.wait(10)
    return port_box[0]


def _serve(delay_s: float) -> None:
    import logging
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    from moto.server import ThreadedMotoServer
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port = server.get_host_and_port()[1]
    proxy_port = _delaying_proxy(port, delay_s) if delay_s > 0 else 0
    print(port, proxy_port, flush=True)
    sys.stdin.read()            # until the parent closes our stdin (or dies)
    server.stop()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        _serve(float(sys.argv[2]))
