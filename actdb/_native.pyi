"""Types of the compiled kernels (actdb/_native.c)."""

from typing import Any as Buffer  # a buffer (collections.abc.Buffer from Python 3.12)

PATH: str  # "avx2" or "portable": the f16_dots path this CPU takes
CRC_PATH: str  # "sse4.2" or "portable"

def f16_dots(x: Buffer, v: Buffer, out: Buffer, portable: bool = ..., /) -> None: ...
def crc32c(data: Buffer, portable: bool = ..., /) -> int: ...
def read_chunks(paths: list[bytes], buf: Buffer, nbytes: int, crc: bool, check: bool, /
                ) -> list[int | None]: ...
def split_rows(x: Buffer, y: Buffer, h: Buffer, norm: Buffer, mean: Buffer, gain: Buffer,
               bias: Buffer, d: int, centered: bool, eps: float, portable: bool = ..., /
               ) -> float: ...
