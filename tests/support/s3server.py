"""A local S3 server for the tests: moto's ThreadedMotoServer on 127.0.0.1, a free port."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

BUCKET = "actdb-test"
ENV_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION",
            "AWS_DEFAULT_REGION")


@dataclass(frozen=True, kw_only=True)
class S3Server:
    endpoint: str
    bucket: str

    def env(self) -> dict[str, str]:
        """The AWS variables a client needs to reach this server (fake credentials)."""
        return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1",
                "AWS_DEFAULT_REGION": "us-east-1"}

    def url(self, name: str = "s.actdb") -> str:
        """A fresh store URL: every test gets a prefix of its own."""
        return f"s3://{self.bucket}/{uuid.uuid4().hex[:12]}/{name}"

    def client(self):  # type: ignore[no-untyped-def]
        """boto3, independent of actdb's own client, for the tests' reference reads."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")


@contextmanager
def running() -> Iterator[S3Server]:
    from moto.server import ThreadedMotoServer

    # werkzeug logs a line per request (S3LOG=1 keeps them, to count requests)
    logging.getLogger("werkzeug").setLevel(logging.INFO if os.environ.get("S3LOG")
                                           else logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        s3 = S3Server(endpoint=f"http://{host}:{port}", bucket=BUCKET)
        s3.client().create_bucket(Bucket=BUCKET)
        yield s3
    finally:
        server.stop()
