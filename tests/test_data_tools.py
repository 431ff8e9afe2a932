"""data_tools: IDX validation, preparation from every source, concurrent preparation, loading errors."""
import gzip
import multiprocessing as mp
import struct
from pathlib import Path

import numpy as np
import pytest

from conftest import PYTHON, REPO, run
from data_tools import datasets
from data_tools.datasets import DataError, InMemoryMNIST, load_split, prepare, read_split
from data_tools.idx import IMAGES_MAGIC, LABELS_MAGIC, IDXError, read_idx, write_idx

SIZES = {"train": 60_000, "test": 10_000}


def fake_source(tmp_path: Path, gz=False, seed=0) -> Path:
    """Four valid IDX files with the real sizes and random content (seeded, so sources can be told apart)."""
    rng = np.random.default_rng(seed)
    src = tmp_path / f"source{seed}"
    src.mkdir()
    for split, (images_name, labels_name, n) in datasets.SPLITS.items():
        for name, array in ((images_name, rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)),
                            (labels_name, rng.integers(0, 10, n, dtype=np.uint8))):
            write_idx(src / name, array)
            if gz:
                (src / (name + ".gz")).write_bytes(gzip.compress((src / name).read_bytes(), compresslevel=1))
                (src / name).unlink()
    return src


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return fake_source(tmp_path_factory.mktemp("idx"))


# ------------------------------------------------------------------------------------------------ IDX

def test_idx_round_trip(tmp_path):
    a = np.arange(3 * 28 * 28, dtype=np.uint8).reshape(3, 28, 28)
    write_idx(tmp_path / "x", a)
    assert np.array_equal(read_idx(tmp_path / "x", IMAGES_MAGIC, (3, 28, 28)), a)
    (tmp_path / "x.gz").write_bytes(gzip.compress((tmp_path / "x").read_bytes()))
    assert np.array_equal(read_idx(tmp_path / "x.gz", IMAGES_MAGIC, (3, 28, 28)), a)


@pytest.mark.parametrize("damage, message", [
    (lambda raw: raw[:-100], "truncated"),
    (lambda raw: raw + b"\0", "trailing bytes"),
    (lambda raw: struct.pack(">I", 0x0801) + raw[4:], "magic number 0x00000801"),
    (lambda raw: raw[:2], "too short"),
    (lambda raw: raw[:4] + struct.pack(">I", 2) + raw[8:], "shape (2, 28, 28)"),
])
def test_idx_damage_is_named(tmp_path, damage, message):
    a = np.zeros((3, 28, 28), dtype=np.uint8)
    write_idx(tmp_path / "x", a)
    (tmp_path / "x").write_bytes(damage((tmp_path / "x").read_bytes()))
    with pytest.raises(IDXError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        read_idx(tmp_path / "x", IMAGES_MAGIC, (3, 28, 28))
    assert str(tmp_path / "x") in str(e.value)


def test_idx_wrong_count_and_bad_gzip(tmp_path):
    write_idx(tmp_path / "labels", np.zeros(9, dtype=np.uint8))
    with pytest.raises(IDXError, match=r"shape \(9,\), expected \(10,\)"):
        read_idx(tmp_path / "labels", LABELS_MAGIC, (10,))
    (tmp_path / "bad.gz").write_bytes(b"not gzip at all")
    with pytest.raises(IDXError, match="cannot be read"):
        read_idx(tmp_path / "bad.gz", LABELS_MAGIC, (10,))
    with pytest.raises(IDXError, match="not found"):
        read_idx(tmp_path / "missing", LABELS_MAGIC, (10,))


# ------------------------------------------------------------------------------------------ preparation

def test_prepare_from_named_directory_gz_and_plain(tmp_path, source):
    for gz in (False, True):
        src = source if not gz else fake_source(tmp_path, gz=True, seed=1)
        data = tmp_path / f"data{gz}"
        prepare("fashion-mnist", data, source=src, log=lambda *_: None)
        assert (data / "FashionMNIST" / "READY").exists()
        for split in SIZES:
            got, want = read_split(data / "FashionMNIST" / "raw", split), read_split(src, split)
            assert all(np.array_equal(g, w) for g, w in zip(got, want))
        images, labels = load_split("fashion-mnist", "train", data)
        assert tuple(images.shape) == (60_000, 28, 28) and labels.dtype.is_floating_point is False


def test_prepare_is_idempotent_and_refuses_foreign_dirs(tmp_path, source):
    data = tmp_path / "data"
    prepare("mnist", data, source=source, log=lambda *_: None)
    messages = []
    prepare("mnist", data, log=messages.append)  # no source needed the second time
    assert "already prepared" in messages[0]
    (data / "MNIST" / "READY").unlink()
    with pytest.raises(DataError, match="--force"):
        prepare("mnist", data, log=lambda *_: None)


def test_prepare_rejects_a_bad_source_and_leaves_nothing(tmp_path, source):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in source.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    train_images = bad / "train-images-idx3-ubyte"
    train_images.write_bytes(train_images.read_bytes()[:-1])
    data = tmp_path / "data"
    with pytest.raises(DataError, match="truncated"):
        prepare("fashion-mnist", data, source=bad, log=lambda *_: None)
    assert [p.name for p in data.iterdir()] == [".FashionMNIST.lock"]  # no half-written dataset


def _prepare_in_child(data, src, barrier):
    barrier.wait()
    prepare("fashion-mnist", data, source=src, log=lambda *_: None)


def test_concurrent_preparations_do_not_corrupt(tmp_path, source):
    data = tmp_path / "data"
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(3)
    procs = [ctx.Process(target=_prepare_in_child, args=(data, source, barrier)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert sorted(p.name for p in data.iterdir()) == [".FashionMNIST.lock", "FashionMNIST"]  # no temp dirs
    for split in SIZES:
        got, want = read_split(data / "FashionMNIST" / "raw", split), read_split(source, split)
        assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_lessons_name_the_prepare_command_when_data_is_missing(tmp_path):
    with pytest.raises(DataError, match=r"python data_tools/prepare_data.py --dataset mnist --data-dir"):
        load_split("mnist", "train", tmp_path / "empty")
    proc = run([PYTHON, REPO / "day1/2_mnist_training.py", "--data-dir", tmp_path / "empty",
                "--run-dir", tmp_path / "run"], check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0, proc.stderr  # one line
    assert "not prepared" in proc.stderr and "prepare_data.py" in proc.stderr


def test_damaged_data_dir_names_the_fix(tmp_path, source):
    data = tmp_path / "data"
    prepare("fashion-mnist", data, source=source, log=lambda *_: None)
    labels = data / "FashionMNIST" / "raw" / "t10k-labels-idx1-ubyte"
    labels.write_bytes(b"\x00\x00\x08\x03" + labels.read_bytes()[4:])
    with pytest.raises(DataError, match="damaged.*--force"):
        load_split("fashion-mnist", "test", data)


def test_prepare_command_line(tmp_path, source):
    data = tmp_path / "data"
    ok = run([PYTHON, REPO / "data_tools/prepare_data.py", "--dataset", "mnist", "--data-dir", data,
              "--source", source])
    assert "prepared in" in ok.stdout
    bad = run([PYTHON, REPO / "data_tools/prepare_data.py", "--dataset", "mnist", "--data-dir", tmp_path / "d2",
               "--source", tmp_path / "nowhere"], check=False)
    assert bad.returncode == 1 and "does not hold a usable dataset" in bad.stderr


def test_download_failure_is_one_clear_line(tmp_path):
    """Offline (as on many compute nodes) the download fails fast and says what to do.  A proxy that
    refuses every connection makes "offline" certain whatever network the test machine has."""
    proc = run([PYTHON, REPO / "data_tools/prepare_data.py", "--dataset", "mnist", "--data-dir", tmp_path,
                "--download-timeout", "3"], check=False, timeout=120,
               env={"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"})
    assert proc.returncode == 1
    assert "could not download mnist" in proc.stderr and "--source" in proc.stderr
    assert not (tmp_path / "MNIST").exists()


# ------------------------------------------------------------------------------------------ in memory

def test_in_memory_dataset_is_the_real_data_normalized(dataset):
    train = InMemoryMNIST(dataset, "train")
    images, labels = load_split(dataset, "train")
    assert len(train) == 60_000 and tuple(train.images.shape) == (60_000, 1, 28, 28)
    s = datasets.spec(dataset)
    assert abs(train.images.mean().item()) < 0.01 and abs(train.images.std().item() - 1) < 0.01  # mean/std
    x, y = train[[5, 0, 7]]
    assert x.shape == (3, 1, 28, 28) and y.tolist() == labels[[5, 0, 7]].tolist()
    assert np.allclose(x[1, 0].numpy(), (images[0].numpy() / 255 - s.mean) / s.std, atol=1e-6)
    assert sorted(np.bincount(labels.numpy())) == [6000] * 10  # Fashion-MNIST's classes are balanced


@pytest.mark.parametrize("world_size, limit, batch", [(3, 1001, 64), (2, 640, 50)])
def test_the_two_loaders_of_the_lessons_give_the_same_batches_in_the_same_order(dataset, world_size, limit, batch):
    """--loader dataloader (DataLoader(dataset, batch_size=..., sampler=DistributedSampler(...)), the loop a
    learner writes for any dataset) and --loader memory (batches(), one gather per batch) yield the same
    batches, bit for bit, for every rank and epoch, padding included."""
    import torch
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from data_tools.datasets import batches

    train = InMemoryMNIST(dataset, "train", limit=limit)
    for rank in range(world_size):
        sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True, seed=3)
        loader = DataLoader(train, batch_size=batch, sampler=sampler)
        firsts = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            expected = list(loader)
            got = list(batches(train, sampler, batch))
            assert len(got) == len(expected) == -(-len(sampler) // batch)
            for (x, y), (ex, ey) in zip(got, expected):
                assert torch.equal(x, ex) and torch.equal(y, ey) and y.dtype == ey.dtype == torch.int64
            firsts.append(got[0][0])
        assert not torch.equal(*firsts)  # set_epoch reshuffled: both loaders follow the sampler
