"""An S3 prefix holding one store: parsing `s3://` URLs, the client configuration (AWS
environment variables plus explicit `storage_options`), and the few object operations the
store needs, with object-storage errors turned into ours."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import obstore
from obstore.exceptions import AlreadyExistsError, PreconditionError
from obstore.store import S3Store

from ..errors import StoreFormatError, StoreNotFoundError, StoreStorageError
from .location import SCHEME, is_remote

# storage_options keys that configure the HTTP client rather than S3 itself.
_CLIENT_KEYS = {"allow_http", "allow_invalid_certificates", "connect_timeout", "timeout"}


@dataclass(frozen=True, kw_only=True)
class S3Url:
    bucket: str
    prefix: str  # the store's key prefix, no leading or trailing slash

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}"


def parse_url(url: str) -> S3Url:
    """`s3://bucket/some/prefix/name.actdb` -> bucket and prefix; anything else is an error."""
    rest = url[len(SCHEME):] if url.startswith(SCHEME) else ""
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not bucket or not prefix or "//" in prefix:
        raise StoreFormatError(
            f"store URL {url!r} must be s3://BUCKET/PREFIX with a non-empty key prefix "
            "(e.g. s3://my-bucket/runs/demo.actdb)"
        )
    return S3Url(bucket=bucket, prefix=prefix)


def client_options(storage_options: Mapping[str, Any] | None) -> tuple[dict[str, Any],
                                                                      dict[str, Any]]:
    """(S3 config, client options) from the environment and explicit `storage_options`.

    obstore reads the usual AWS variables itself (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
    AWS_SESSION_TOKEN, AWS_REGION, AWS_ENDPOINT_URL, ...); added here: AWS_ENDPOINT_URL_S3
    (the AWS CLI's per-service endpoint), and plain http allowed when the endpoint is http
    (a local server), since nobody configures a local endpoint to be refused."""
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    endpoint_s3 = os.environ.get("AWS_ENDPOINT_URL_S3")
    if endpoint_s3:
        config["endpoint"] = endpoint_s3
    for key, value in (storage_options or {}).items():
        name = key.lower().removeprefix("aws_")
        if name in ("endpoint_url", "endpoint"):
            config["endpoint"] = value
        elif name in _CLIENT_KEYS:
            client[name] = value
        elif name == "key":  # fsspec/s3fs spellings, so one dict works for both
            config["access_key_id"] = value
        elif name == "secret":
            config["secret_access_key"] = value
        elif name == "region_name":
            config["region"] = value
        else:
            config[name] = value
    endpoint = str(config.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL")
                   or os.environ.get("AWS_ENDPOINT") or "")
    if endpoint.startswith("http://") and "allow_http" not in client:
        client["allow_http"] = True
    return config, client


class Objects:
    """The objects under one prefix (`root` = the store's prefix in its bucket)."""

    def __init__(self, url: S3Url, storage_options: Mapping[str, Any] | None = None,
                 *, sub: str = "") -> None:
        self.url = url
        self.storage_options = dict(storage_options or {})
        prefix = f"{url.prefix}/{sub}".rstrip("/")
        config, client = client_options(storage_options)
        try:
            self.store = S3Store(url.bucket, prefix=prefix, config=cast(Any, config),
                                 client_options=cast(Any, client))
        except Exception as e:
            raise StoreStorageError(
                f"cannot configure object storage for {str(url)!r}: {_first_line(e)}"
            ) from None

    def child(self, sub: str) -> Objects:
        return Objects(self.url, self.storage_options, sub=sub)

    def where(self, key: str) -> str:
        return f"{self.url}/{key}"

    @contextmanager
    def errors(self, key: str, doing: str) -> Iterator[None]:
        """Storage failures (network, credentials, a missing bucket) as one sentence."""
        try:
            yield
        except (FileNotFoundError, AlreadyExistsError, PreconditionError):
            raise
        except Exception as e:
            raise StoreStorageError(
                f"object storage failed while {doing} {self.where(key)!r}: {_first_line(e)}"
            ) from None

    def get(self, key: str) -> tuple[bytes, str | None]:
        """The object's bytes and its ETag; FileNotFoundError when absent."""
        with self.errors(key, "reading"):
            res = obstore.get(self.store, key)
            return bytes(res.bytes()), res.meta.get("e_tag")

    def get_range(self, key: str, start: int, end: int) -> memoryview:
        """Bytes [start, end) of an object (a short read when the object is shorter)."""
        with self.errors(key, "reading"):
            return memoryview(obstore.get_range(self.store, key, start=start, end=end))

    def get_suffix(self, key: str, n: int) -> tuple[memoryview, int]:
        """The last `n` bytes of an object (all of it when shorter) and the object's size, in
        one request."""
        with self.errors(key, "reading"):
            res = obstore.get(self.store, key, options={"range": {"suffix": n}})
            return memoryview(res.bytes()), int(res.meta["size"])

    def size(self, key: str) -> int | None:
        with self.errors(key, "reading"):
            try:
                return int(obstore.head(self.store, key)["size"])
            except FileNotFoundError:
                return None

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False,
            if_match: str | None = None) -> str | None:
        """Write an object whole (PUT is atomic: readers see the old or the new one); with
        `if_absent` or `if_match`, a conditional write that raises AlreadyExistsError /
        PreconditionError when another writer got there first. Returns the new ETag."""
        mode: Any = "create" if if_absent else (
            {"e_tag": if_match} if if_match else "overwrite")
        with self.errors(key, "writing"):
            res = obstore.put(self.store, key, data, mode=mode)
        return res.get("e_tag")

    def delete(self, key: str) -> None:
        with self.errors(key, "deleting"):
            try:
                obstore.delete(self.store, key)
            except FileNotFoundError:
                pass

    def list(self, sub: str = "") -> list[tuple[str, int]]:
        """(key, size) of every object under `sub`."""
        out = []
        with self.errors(sub, "listing"):
            for page in obstore.list(self.store, sub or None):
                out += [(str(o["path"]), int(o["size"])) for o in page]
        return out

    def exists(self, key: str) -> bool:
        return self.size(key) is not None


def not_found(url: S3Url) -> StoreNotFoundError:
    return StoreNotFoundError(f"no store at {str(url)!r}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


__all__ = ["AlreadyExistsError", "Objects", "PreconditionError", "S3Url", "is_remote",
           "parse_url"]
