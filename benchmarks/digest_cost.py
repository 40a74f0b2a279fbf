"""What checking each chunk against the digest of its place (format 4) costs a full read of a
store's vectors, beside each chunk's own CRC-32C: every direction, norm and mean chunk of every
site read in runs of 16 chunks through the store's run reader, with the digests checked and not
(`Arrays.expected = None`), paired round by round (method.py): the median of per-round ratios and
their spread.

    python benchmarks/digest_cost.py [--tokens N] [--rounds R] [--store PATH]
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

from generate import Shape, generate
from method import paired

from actdb.store.arrays import ACT_FIELDS
from actdb.store.store import Store

RUN = 16


def read_all(st: Store) -> int:
    n = 0
    for m in st.catalog.models():
        for s in st.catalog.sites(m.model):
            for field in ACT_FIELDS:
                c = st.arrays.act_info(m.model_id, s.site, field).chunks[0]
                chunks = -(-m.n_rows // c)
                for first in range(0, chunks, RUN):
                    n += st.arrays.read_chunks(m.model_id, s.site, field, first,
                                               min(RUN, chunks - first)).nbytes
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--store", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.store or Path(tmp) / "s.actdb"
        if not path.exists():
            generate(path, tokens=args.tokens, shape=Shape(n_sites=4), seed=0)
        with Store(path) as st:
            digests = st.arrays.expected
            assert digests is not None, "a format-4 store records digests"
            size = read_all(st)  # warm: page cache, digests loaded

            def check(on: bool) -> Callable[[], None]:
                def setup() -> None:
                    st.arrays.expected = digests if on else None
                return setup

            ratio = paired(lambda: read_all(st), lambda: read_all(st), args.rounds,
                           warmup=False, actdb_setup=check(True), baseline_setup=check(False))
            st.arrays.expected = digests
    print(f"{size / 1e6:.0f} MB of chunks a read; digests checked {ratio.seconds:.3f} s, "
          f"not {ratio.baseline_seconds:.3f} s (medians of {args.rounds})")
    print(f"ratio checked / unchecked: median {ratio.median:.3f}, range {ratio.spread}")


if __name__ == "__main__":
    main()
