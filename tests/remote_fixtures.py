"""Remote caches for tests: a real S3-compatible server (moto's, on 127.0.0.1) and a plain folder,
each with a raw writer so a test can plant what an attacker with write access would."""
from __future__ import annotations

from pathlib import Path

import pytest

BUCKET = "optpipe-cache"


@pytest.fixture(scope="module")
def s3_url():
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": f"http://{host}:{port}", "region_name": "us-east-1"}}
    import boto3  # moto's dependency; s3fs's mkdir sends a location constraint moto's us-east-1 refuses

    boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket=BUCKET)
    yield f"s3://{BUCKET}/team", options
    server.stop()


class Remote:
    """A remote cache under test: its URL, fsspec options, and raw access to its objects."""

    def __init__(self, url: str, options: dict):
        import fsspec

        self.url, self.options = url, options
        self.fs, self.root = fsspec.core.url_to_fs(url, **options)

    def put(self, relative: str, data: bytes) -> None:
        path = f"{self.root}/{relative}"
        if "file" in self.fs.protocol:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.fs.pipe_file(path, data)

    def get(self, relative: str) -> bytes:
        return self.fs.cat_file(f"{self.root}/{relative}")


@pytest.fixture(params=["file", "s3"])
def remote(request, tmp_path_factory) -> Remote:
    """Each test once on a file:// folder and once on S3 (a fresh prefix per test)."""
    if request.param == "file":
        return Remote(f"file://{tmp_path_factory.mktemp('shared')}/remote", {})
    url, options = request.getfixturevalue("s3_url")
    return Remote(f"{url}/{request.node.name.replace('[', '-').replace(']', '')}", options)
