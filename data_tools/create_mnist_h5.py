#!/usr/bin/env python
"""Write MNIST or Fashion-MNIST into one chunked HDF5 file, the input of lesson 11 (streaming).

    python data_tools/create_mnist_h5.py                        # -> data/fashion-mnist-chunk1000.h5
    python data_tools/create_mnist_h5.py --chunk-samples 500    # -> data/fashion-mnist-chunk500.h5
    python data_tools/create_mnist_h5.py --dataset mnist --output /scratch/$USER/mnist.h5

Images stay uint8 (55 MB for both splits) and are stored in HDF5 chunks of --chunk-samples samples:
the chunk is the unit HDF5 reads, so it is the unit lesson 11 shards across ranks.  Larger chunks mean
fewer, larger reads (good on parallel filesystems) but a coarser shuffle and more uneven shards.
--checksum adds a fletcher32 checksum to every chunk, verified on every read: a damaged chunk fails
instead of feeding garbage, at up to about a third of warm streaming speed (benchmarks/bench.py).
Run it once, on a login node or a laptop, after data_tools/prepare_data.py; never on every rank.
The file is written under a temporary name and renamed, so a reader never sees half a file; an existing
file is reused only if it has exactly the asked layout and data, and replaced only with --force.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for data_tools/

from course.launching.cli import Parser  # one-line usage errors, as in every lesson
from data_tools.datasets import DATASETS, DEFAULT_DATASET, DataError, default_data_dir, read_split, require, spec
from data_tools.h5layout import (DEFAULT_CHUNK_SAMPLES, SPLIT_SIZES, H5LayoutError, default_h5_path, read_layout,
                                 source_sha256, write_h5)
from data_tools.idx import IDXError

PROG = "data_tools/create_mnist_h5.py"
COMPRESSIONS = ("none", "gzip", "lzf")


def chunk_samples(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= min(SPLIT_SIZES.values()):
        raise argparse.ArgumentTypeError(f"{value} must be between 1 and {min(SPLIT_SIZES.values())}")
    return value


def create(args) -> int:
    data_dir = args.data_dir or default_data_dir()
    output = args.output or default_h5_path(args.dataset, data_dir, args.chunk_samples)
    require(args.dataset, data_dir)
    raw = data_dir / spec(args.dataset).folder / "raw"
    try:
        splits = {split: read_split(raw, split) for split in SPLIT_SIZES}  # checked IDX arrays, no torch needed
    except IDXError as e:
        raise DataError(f"{args.dataset} in {data_dir} is damaged ({e}); rebuild it with: "
                        f"python data_tools/prepare_data.py --dataset {args.dataset} --force") from None
    fingerprint = source_sha256(splits)

    if output.exists() and not args.force:
        try:
            layout = read_layout(output)
        except H5LayoutError as e:
            raise DataError(f"{output} exists but is not a usable file ({e.why}); replace it with --force, "
                            f"or write elsewhere with --output") from None
        asked = {"dataset": args.dataset, "chunk_samples": args.chunk_samples,
                 "compression": args.compression, "checksum": args.checksum,
                 "source data (sha256)": fingerprint[:12]}
        found = {"dataset": layout.dataset, "chunk_samples": layout.chunk_samples,
                 "compression": layout.compression, "checksum": layout.checksum,
                 "source data (sha256)": layout.source_sha256[:12]}
        differ = [f"{k} {found[k]} (asked: {asked[k]})" for k in asked if asked[k] != found[k]]
        if differ:
            raise DataError(f"{output} already exists with another layout: {', '.join(differ)}; "
                            f"replace it with --force, or write elsewhere with --output")
        print(f"{output} already exists with this layout and data; reusing it (--force rewrites it)")
        print(layout.describe())
        return 0

    layout = write_h5(output, splits, args.dataset, args.chunk_samples, args.compression, args.checksum)
    print(f"wrote {output} ({output.stat().st_size / 1e6:.1f} MB)")
    print(layout.describe())
    default = default_h5_path(args.dataset, default_data_dir())
    if Path(output).resolve() != default.resolve():
        print(f"lesson 11 reads it with: --dataset {args.dataset} --h5-file {output}")
    return 0


def build_parser():
    p = Parser(prog=PROG, description=__doc__.strip().split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", default=DEFAULT_DATASET, choices=sorted(DATASETS))
    p.add_argument("--data-dir", type=Path, default=None,
                   help="prepared data dir to read from (default: $COURSE_DATA_DIR or data/ in the repository)")
    p.add_argument("--chunk-samples", type=chunk_samples, default=DEFAULT_CHUNK_SAMPLES,
                   help="samples per HDF5 chunk (the unit of reading and of sharding across ranks)")
    p.add_argument("--compression", default="none", choices=COMPRESSIONS,
                   help="none reads fastest; gzip makes the file smaller (Fashion-MNIST: 31 MB instead of 55 MB) "
                        "and costs CPU on every read")
    p.add_argument("--checksum", action="store_true",
                   help="a fletcher32 checksum per chunk, verified on every read: a damaged chunk fails instead "
                        "of feeding garbage; costs up to about a third of warm streaming speed")
    p.add_argument("--output", type=Path, default=None,
                   help="the file to write (default: <data dir>/<dataset>-chunk<N>.h5)")
    p.add_argument("--force", action="store_true", help="replace an existing file whatever it holds")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return create(args)
    except (DataError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
