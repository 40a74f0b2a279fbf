"""Read throughput of a store on a local S3 server (moto) against the same store on local disk.

The same synthetic store (benchmarks/generate.py, fixed seed) is written to a local directory
and to `s3://bench/...` on a ThreadedMotoServer on 127.0.0.1; then, alternating between the
two, medians of `--repeats` runs of:

- raw chunk reads: every direction chunk of every site through `Arrays.read_chunk` (checked),
  one at a time, then with 8 threads (what the read-ahead keeps in flight on object storage);
- a full-scan query, `sum(cosine_to_anchor(vec, 5))` over every row, with its read-ahead.

    python benchmarks/s3_read.py [--tokens 8192] [--sites 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from generate import Shape, generate  # noqa: E402

import actdb  # noqa: E402
from actdb.store.store import Store  # noqa: E402

QUERY = "SELECT sum(cosine_to_anchor(vec, 5)) FROM acts"


def _read_all(location: str, threads: int) -> tuple[float, int]:
    """Seconds to read every committed direction chunk of every site, and the bytes read."""
    with Store(location) as st:
        model = st.catalog.models()[0]
        jobs = []
        for s in st.catalog.sites(model.model):
            c = st.arrays.act_array(model.model_id, s.site, "direction").chunks[0]
            jobs += [(s.site, i) for i in range(-(-model.n_rows // c))]
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            sizes = list(pool.map(
                lambda j: st.arrays.read_chunk(model.model_id, j[0], "direction", j[1]).nbytes,
                jobs))
        return time.perf_counter() - start, sum(sizes)


def _scan(location: str) -> float:
    with actdb.connect(location, device="cpu") as db:
        start = time.perf_counter()
        db.sql(QUERY).fetchall()
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--sites", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        import boto3

        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                          AWS_ENDPOINT_URL=endpoint, AWS_REGION="us-east-1")
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
            Bucket="bench")
        shape = Shape(d=768, vocab=8192, n_sites=args.sites, prompt_tokens=128,
                      batch_tokens=4096)
        with tempfile.TemporaryDirectory() as tmp:
            stores = {"local disk": str(Path(tmp) / "bench.actdb"),
                      "local S3 (moto)": "s3://bench/runs/bench.actdb"}
            for location in stores.values():
                generate(location, tokens=args.tokens, shape=shape)  # type: ignore[arg-type]
            times: dict[tuple[str, str], list[float]] = {}
            nbytes = 0
            for _ in range(args.repeats):
                for name, location in stores.items():
                    for threads in (1, 8):
                        t, nbytes = _read_all(location, threads)
                        times.setdefault((name, f"chunks, {threads} thread(s)"), []).append(t)
                    times.setdefault((name, "full-scan query"), []).append(_scan(location))
        mb = nbytes / 1e6
        print(f"{args.sites} sites x {args.tokens} tokens, d = 768: {mb:.1f} MB of direction "
              f"chunks; medians of {args.repeats}\n")
        print("| read | local disk | local S3 (moto) | S3 / disk |")
        print("|---|---|---|---|")
        for what in ("chunks, 1 thread(s)", "chunks, 8 thread(s)", "full-scan query"):
            disk = statistics.median(times[("local disk", what)])
            s3 = statistics.median(times[("local S3 (moto)", what)])
            unit = (f"{mb / disk:.0f} MB/s", f"{mb / s3:.0f} MB/s") if what.startswith(
                "chunks") else (f"{disk:.2f} s", f"{s3:.2f} s")
            print(f"| {what} | {unit[0]} | {unit[1]} | {s3 / disk:.1f}x the time |")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
