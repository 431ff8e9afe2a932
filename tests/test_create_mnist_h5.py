"""data_tools/create_mnist_h5.py: layout, chunking, round trip, reuse rules, and clear errors for bad files."""
import hashlib
import os
import shutil

import h5py
import numpy as np
import pytest
import torch

from conftest import PYTHON, REPO, run
from data_tools.datasets import DataError, load_split
from data_tools.h5layout import H5LayoutError, read_layout, write_h5
from data_tools.h5stream import H5Chunks


CREATE = REPO / "data_tools/create_mnist_h5.py"


def create(*args, **kw):
    return run([PYTHON, CREATE, *args], check=False, timeout=120, **kw)


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def one_line_error(proc, *needles):
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.quick("create_mnist_h5")
def test_round_trip_equals_the_source_arrays(mnist_h5):
    with h5py.File(mnist_h5.path, "r") as f:
        assert dict(f.attrs)["dataset"] == mnist_h5.dataset
        for split in ("train", "test"):
            images, labels = (t.numpy() for t in load_split(mnist_h5.dataset, split))
            assert f[f"{split}/images"].dtype == np.uint8 and f[f"{split}/labels"].dtype == np.uint8
            assert np.array_equal(f[f"{split}/images"][:], images)
            assert np.array_equal(f[f"{split}/labels"][:], labels)


def test_chunk_shape_is_the_one_asked_and_the_layout_is_printed(mnist_h5):
    with h5py.File(mnist_h5.path, "r") as f:
        for split in ("train", "test"):
            assert f[f"{split}/images"].chunks == (700, 28, 28)
            assert f[f"{split}/labels"].chunks == (700,)
    layout = read_layout(mnist_h5.path)
    assert (layout.chunk_samples, layout.chunks("train"), layout.chunks("test")) == (700, 86, 15)
    assert "chunks of 700 samples" in mnist_h5.stdout
    assert "86 chunks (the last one 500)" in mnist_h5.stdout   # 60000 = 85 x 700 + 500
    assert "15 chunks (the last one 200)" in mnist_h5.stdout   # 10000 = 14 x 700 + 200


def test_default_name_then_reuse_only_the_same_layout(dataset, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "FashionMNIST").symlink_to(REPO / "data" / "FashionMNIST")  # the prepared dataset, not a copy
    first = create("--data-dir", data, "--chunk-samples", "2500")
    assert first.returncode == 0, first.stderr
    path = data / f"{dataset}-chunk2500.h5"
    assert f"wrote {path}" in first.stdout
    before = os.stat(path)
    again = create("--data-dir", data, "--chunk-samples", "2500")
    assert again.returncode == 0, again.stderr
    assert "reusing it" in again.stdout and "chunks of 2500 samples" in again.stdout
    after = os.stat(path)
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)
    assert sorted(p.name for p in data.iterdir()) == ["FashionMNIST", path.name]  # no temporary file left


def test_a_file_of_another_layout_is_never_silently_reused(mnist_h5, tmp_path):
    path = tmp_path / "other.h5"
    shutil.copy(mnist_h5.path, path)
    digest = sha(path)
    refused = create("--output", path, "--chunk-samples", "1000")
    one_line_error(refused, "another layout", "chunk_samples 700 (asked: 1000)", "--force")
    refused = create("--output", path, "--chunk-samples", "700", "--compression", "gzip")
    one_line_error(refused, "compression none (asked: gzip)")
    assert sha(path) == digest  # untouched
    forced = create("--output", path, "--chunk-samples", "1000", "--force")
    assert forced.returncode == 0, forced.stderr
    assert read_layout(path).chunk_samples == 1000


def test_a_truncated_file_is_a_clear_error(mnist_h5, tmp_path):
    path = tmp_path / "truncated.h5"
    path.write_bytes(mnist_h5.path.read_bytes()[: os.path.getsize(mnist_h5.path) // 2])
    one_line_error(create("--output", path, "--chunk-samples", "700"), "truncated file", "--force")
    with pytest.raises(DataError, match="truncated file"):
        read_layout(path)
    with pytest.raises(DataError, match=r"truncated file.*create_mnist_h5.py"):
        H5Chunks(path, "train")  # what lesson 11 does first


def _not_hdf5(path):
    path.write_text("images,labels\n")


def _no_attributes(path):
    with h5py.File(path, "w") as f:
        f["train/images"] = np.zeros((60000, 28, 28), np.uint8)


def _empty_layout(path, chunk_samples=100, chunks=100):
    with h5py.File(path, "w") as f:
        f.attrs.update(format="course-mnist-h5", version=1, dataset="fashion-mnist", chunk_samples=chunk_samples)
        for split, n in (("train", 60000), ("test", 10000)):
            f.create_dataset(f"{split}/images", shape=(n, 28, 28), dtype=np.uint8, chunks=(chunks, 28, 28))
            f.create_dataset(f"{split}/labels", shape=(n,), dtype=np.uint8, chunks=(chunks,))


def _wrong_chunks(path):
    _empty_layout(path, chunk_samples=100, chunks=50)


def _missing_labels(path):
    _empty_layout(path)
    with h5py.File(path, "a") as f:
        del f["test/labels"]


def _float_images(path):
    with h5py.File(path, "w") as f:
        f.attrs.update(format="course-mnist-h5", version=1, dataset="fashion-mnist", chunk_samples=50)
        f.create_dataset("train/images", shape=(60000, 28, 28), dtype=np.float32, chunks=(50, 28, 28))


@pytest.mark.parametrize("make, why", [
    (_not_hdf5, "file signature not found"),
    (_no_attributes, "format attribute None"),
    (_wrong_chunks, "train/images has HDF5 chunks (50, 28, 28), expected (100, 28, 28)"),
    (_missing_labels, "no dataset test/labels"),
    (_float_images, "train/images is float32 (60000, 28, 28), expected uint8"),
])
def test_malformed_files_are_clear_errors(tmp_path, make, why):
    path = tmp_path / "bad.h5"
    make(path)
    with pytest.raises(H5LayoutError) as error:
        read_layout(path)
    assert why in error.value.why
    assert "\n" not in str(error.value) and "create_mnist_h5.py" in str(error.value)
    one_line_error(create("--output", path), why, "--force")


@pytest.fixture(scope="module")
def checksummed_h5(mnist_h5, tmp_path_factory):
    """The session's file again, made with --checksum: a fletcher32 checksum per chunk."""
    path = tmp_path_factory.mktemp("checksummed") / "checksummed.h5"
    made = create("--dataset", mnist_h5.dataset, "--chunk-samples", "700", "--checksum", "--output", path)
    assert made.returncode == 0, made.stderr
    assert "a fletcher32 checksum per chunk" in made.stdout
    return path


def flip(path, dataset, chunk, offset):
    """Flip 4 bytes inside one chunk of `dataset`, as a bad disk or a broken copy would."""
    with h5py.File(path, "r") as f:
        info = f[dataset].id.get_chunk_info(chunk)
    with open(path, "r+b") as f:
        f.seek(info.byte_offset + offset)
        data = f.read(4)
        f.seek(info.byte_offset + offset)
        f.write(bytes(b ^ 0xFF for b in data))
    return info


def test_by_default_no_checksum_and_a_damaged_chunk_goes_unseen(mnist_h5, tmp_path):
    """The trade-off --checksum exists for: without it (h5py's default, and ours) HDF5 cannot tell."""
    assert read_layout(mnist_h5.path).checksum is False and "no checksums" in mnist_h5.stdout
    path = tmp_path / "damaged.h5"
    shutil.copy(mnist_h5.path, path)
    flip(path, "train/images", 3, 100)
    _, images, _ = H5Chunks(path, "train")[(3, None)]
    _, clean, _ = H5Chunks(mnist_h5.path, "train")[(3, None)]
    assert not torch.equal(images, clean)  # read without complaint: other pixels than the file was made with


def test_with_checksum_a_damaged_chunk_is_an_error_when_read_not_garbage(checksummed_h5, tmp_path):
    path = tmp_path / "damaged.h5"
    shutil.copy(checksummed_h5, path)
    info = flip(path, "train/images", 3, 100)  # 4 bytes inside chunk 3's pixels
    assert info.chunk_offset == (2100, 0, 0)
    chunks = H5Chunks(path, "train")
    assert len(chunks[(2, None)][0]) == 700  # the neighbours still read
    with pytest.raises(H5LayoutError, match="chunk 3 of train is damaged or unreadable.*--checksum --output .* --force"):
        chunks[(3, None)]


def test_with_checksum_damaged_labels_are_an_error_on_the_first_read(checksummed_h5, tmp_path):
    path = tmp_path / "damaged-labels.h5"
    shutil.copy(checksummed_h5, path)
    flip(path, "train/labels", 1, 10)  # the labels are read whole, once, on the first read
    with pytest.raises(H5LayoutError, match="the labels of train are damaged or unreadable"):
        H5Chunks(path, "train")[(0, None)]


def test_checksum_or_not_is_part_of_the_layout_a_file_is_reused_for(checksummed_h5, tmp_path):
    path = tmp_path / "c.h5"
    shutil.copy(checksummed_h5, path)
    refused = create("--output", path, "--chunk-samples", "700")
    one_line_error(refused, "another layout", "checksum True (asked: False)", "--force")
    again = create("--output", path, "--chunk-samples", "700", "--checksum")
    assert again.returncode == 0 and "reusing it" in again.stdout, again.stderr


def test_a_failed_write_leaves_nothing_behind(tmp_path):
    good = (np.zeros((60000, 28, 28), np.uint8), np.zeros(60000, np.uint8))
    bad = (np.zeros((10000, 28, 27), np.uint8), np.zeros(10000, np.uint8))  # not 28x28: h5py refuses the chunk
    with pytest.raises(ValueError):
        write_h5(tmp_path / "x.h5", {"train": good, "test": bad}, "fashion-mnist", 700)
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments_and_missing_data(tmp_path):
    for value in ("0", "10001", "many"):
        refused = create("--chunk-samples", value, "--output", tmp_path / "x.h5")
        assert refused.returncode == 2 and "--chunk-samples" in refused.stderr, refused.stderr
    one_line_error(create("--data-dir", tmp_path / "empty"), "is not prepared", "prepare_data.py")
    assert not (tmp_path / "x.h5").exists()
