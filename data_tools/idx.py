"""Reading and validating IDX files, the format of MNIST and Fashion-MNIST.

An IDX file is a 4-byte magic number (0x00 0x00 <dtype> <ndim>), one big-endian uint32 per dimension,
then the data.  Both datasets use dtype 0x08 (uint8): images are 3-d (N, 28, 28), labels 1-d (N,).
"""
import gzip
import struct
from pathlib import Path

import numpy as np

UBYTE = 0x08
IMAGES_MAGIC = 0x00000803  # uint8, 3 dimensions
LABELS_MAGIC = 0x00000801  # uint8, 1 dimension


class IDXError(ValueError):
    """A file that is not the IDX file we expect; the message says which file and what is wrong."""


def _open(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def read_idx(path, expected_magic: int, expected_shape: tuple) -> np.ndarray:
    """Read an IDX file (plain or .gz) and check magic number, shape and size; return a uint8 array."""
    path = Path(path)
    try:
        with _open(path) as f:
            raw = f.read()
    except FileNotFoundError:
        raise IDXError(f"{path}: file not found") from None
    except (OSError, EOFError) as e:  # gzip: truncated or not gzip at all
        raise IDXError(f"{path}: cannot be read ({e})") from None
    if len(raw) < 4:
        raise IDXError(f"{path}: {len(raw)} bytes, too short to be an IDX file")
    (magic,) = struct.unpack(">I", raw[:4])
    if magic != expected_magic:
        raise IDXError(f"{path}: magic number 0x{magic:08x}, expected 0x{expected_magic:08x} "
                       f"(wrong file, or not an IDX file)")
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise IDXError(f"{path}: truncated header")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    if shape != tuple(expected_shape):
        raise IDXError(f"{path}: shape {shape}, expected {tuple(expected_shape)}")
    expected_bytes = header + int(np.prod(shape))
    if len(raw) != expected_bytes:
        what = "truncated" if len(raw) < expected_bytes else "has trailing bytes"
        raise IDXError(f"{path}: {what}: {len(raw)} bytes, expected {expected_bytes}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def write_idx(path, array: np.ndarray) -> None:
    """Write a uint8 array as an IDX file (used by tests and by the preparation step)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    magic = (UBYTE << 8) | array.ndim
    with open(path, "wb") as f:
        f.write(struct.pack(">I", magic))
        f.write(struct.pack(f">{array.ndim}I", *array.shape))
        f.write(array.tobytes())
