"""Shared fixtures: tiny local models (built once per session) and stores ingested from them.

Nothing here touches the network: every model is built from a config and saved to a
temporary directory, then loaded through the real `from_pretrained` path.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from support import s3server  # noqa: E402
from support.prompts import PROMPTS  # noqa: E402
from support.s3server import S3Server  # noqa: E402
from support.tiny_models import build_tiny_model  # noqa: E402

# ACTDB_TEST_DEVICE=cuda runs the suite's tensor work on a GPU: every device a test names as
# `cpu` or `auto` resolves to that one instead, for queries and ingests in this process (CLI
# commands run in subprocesses stay on the CPU). Tests that compare with float64 references
# then check the GPU path against them.
if os.environ.get("ACTDB_TEST_DEVICE"):
    import importlib

    _devices = importlib.import_module("actdb.devices")
    _load = importlib.import_module("actdb.ingestion.load")
    _resolve = _devices.resolve_device

    def _test_device(device: str) -> object:
        return _resolve(os.environ["ACTDB_TEST_DEVICE"] if str(device) in ("cpu", "auto")
                        else device)

    _devices.resolve_device = _test_device
    _load.resolve_device = _test_device


_SLOW_TIER = Path(__file__).parent / "slow"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The slow tier is `slow` as a whole, so `-m "not slow"` keeps meaning what it did.
    for item in items:
        if item.path.is_relative_to(_SLOW_TIER):
            item.add_marker(pytest.mark.slow)
    if os.environ.get("ACTDB_TEST_DEVICE"):
        skip = pytest.mark.skip(reason="checks a CPU-only path; ACTDB_TEST_DEVICE is set")
        for item in items:
            if item.get_closest_marker("cpu_only"):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """family -> directory holding a saved tiny model of that family (built once)."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_tiny_model(family, tmp_path_factory.mktemp(f"model-{family}"))
        return built[family]

    return get


@pytest.fixture(scope="session")
def reference(model_dir: Callable[[str], Path]) -> Callable[[str], object]:
    """family -> its float64 reference run (tests/support/query_reference.py), built once."""
    from support.query_reference import build_reference

    cache: dict[str, object] = {}

    def get(family: str) -> object:
        if family not in cache:
            cache[family] = build_reference(family, model_dir(family), PROMPTS)
        return cache[family]

    return get


@pytest.fixture(scope="session")
def family_store(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Callable[[str], Path]
) -> Callable[[str], Path]:
    """family -> a store holding that family's tiny model ingested over PROMPTS (read-only use).

    Small chunks (8 token rows) so that laziness is visible: PROMPTS span several chunks.
    """
    import actdb

    stores: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in stores:
            path = tmp_path_factory.mktemp(f"store-{family}") / "s.actdb"
            actdb.ingest(path, model=str(model_dir(family)), prompts=PROMPTS, batch_size=4,
                         device="cpu", name=family, chunk_tokens=8)
            stores[family] = path
        return stores[family]

    return get


@pytest.fixture(scope="session")
def two_models(tmp_path_factory: pytest.TempPathFactory,
               model_dir: Callable[[str], Path]) -> Path:
    """A store with two models (gpt2 and llama, different tokenizers) over two prompts."""
    import actdb

    path = tmp_path_factory.mktemp("two-models") / "two.actdb"
    for family in ("gpt2", "llama"):
        actdb.ingest(path, model=str(model_dir(family)), prompts=["The capital of France.",
                                                                   "the the the the"],
                     device="cpu", name=family, chunk_tokens=8)
    return path


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A local S3 server (moto) with a bucket, for the whole session."""
    with s3server.running() as server:
        yield server


@pytest.fixture()
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The local S3 server, with the AWS variables pointing at it for this test only."""
    for key in s3server.ENV_KEYS + ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    return s3_server
