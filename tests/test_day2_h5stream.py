"""Lesson 11's streaming loader on the real file: its ChunkShardSampler and rebatch (defined in the lesson, offered
by data_tools/h5stream.py) over H5Chunks and MemoryChunks: what each epoch yields and how.

Per epoch the ranks together yield exactly the training set, each sample once, checked by index and by
the bytes of images and labels against the IDX source; reads are whole, aligned chunks; the file is opened
lazily, in the process that reads it.
"""
import os
import pickle

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from data_tools.datasets import load_split
from data_tools.h5stream import ChunkShardSampler, H5Chunks, MemoryChunks, rebatch



@pytest.fixture(scope="module")
def source(dataset):
    images, labels = load_split(dataset, "train")
    return images.numpy(), labels.numpy()


def epoch_per_rank(path, chunk, world_size, epoch, limit=0, batch_size=64, workers=0, seed=5):
    """What each rank's loader yields in one epoch: [(indices, images, labels, batch sizes)] per rank."""
    out = []
    for rank in range(world_size):
        chunks = H5Chunks(path, "train", limit=limit)
        sampler = ChunkShardSampler(len(chunks), rank, world_size, seed=seed)
        sampler.set_epoch(epoch)
        loader = DataLoader(chunks, sampler=sampler, batch_size=None, num_workers=workers)
        batches = list(rebatch(loader, batch_size))
        out.append((torch.cat([b[0] for b in batches]).numpy(), torch.cat([b[1] for b in batches]).numpy(),
                    torch.cat([b[2] for b in batches]).numpy(), [len(b[0]) for b in batches],
                    sampler.my_chunks()))
    return out


@pytest.mark.parametrize("world_size, limit", [(4, 0), (3, 6500)])
def test_each_epoch_yields_the_training_set_once_by_index_and_by_bytes(mnist_h5, source, world_size, limit):
    n = limit or 60_000
    images, labels = source
    orders = []
    for epoch in (0, 1):
        ranks = epoch_per_rank(mnist_h5.path, mnist_h5.chunk, world_size, epoch, limit)
        index = np.concatenate([r[0] for r in ranks])
        assert len(index) == n and np.array_equal(np.sort(index), np.arange(n))  # each sample once, no padding
        assert np.array_equal(np.concatenate([r[1] for r in ranks]), images[index])  # the very bytes
        assert np.array_equal(np.concatenate([r[2] for r in ranks]), labels[index])
        for _, _, _, sizes, _ in ranks:
            assert all(s == 64 for s in sizes[:-1]) and 0 < sizes[-1] <= 64  # only each rank's last is short
        chunk_sets = [sorted(r[4]) for r in ranks]
        assert sorted(c for s in chunk_sets for c in s) == list(range(-(-n // mnist_h5.chunk)))
        orders.append((index, chunk_sets))
    assert not np.array_equal(orders[0][0], orders[1][0])  # reshuffled every epoch...
    if world_size > 1:
        assert orders[0][1] != orders[1][1]  # ...and each rank reads other chunks


def test_samples_are_shuffled_within_chunks_the_same_way_from_memory(mnist_h5, source):
    h5 = H5Chunks(mnist_h5.path, "train")
    memory = MemoryChunks(*(torch.from_numpy(a) for a in source), chunk_samples=mnist_h5.chunk)
    sampler = ChunkShardSampler(len(h5), rank=1, world_size=2, seed=5)
    for task in list(sampler)[:3]:
        from_file, from_memory = h5[task], memory[task]
        for a, b in zip(from_file, from_memory):
            assert torch.equal(a, b)
        index = from_file[0]
        assert sorted(index.tolist()) == list(range(task[0] * 700, task[0] * 700 + 700))
        assert not torch.equal(index, index.sort().values)  # shuffled inside the chunk


def test_the_chunk_order_is_the_same_on_every_rank_and_deals_round_robin():
    samplers = [ChunkShardSampler(10, rank, 3, seed=5) for rank in range(3)]  # 10 chunks, e.g. 6500 in 700s
    orders = []
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)
        dealt = [s.my_chunks() for s in samplers]
        order = [c for i in range(4) for d in dealt for c in d[i:i + 1]]  # read back in the order dealt
        assert sorted(order) == list(range(10))  # every chunk to exactly one rank (one order, dealt): not padded
        assert [s.my_chunks() for s in samplers] == dealt  # the same again: a pure function of seed and epoch
        orders.append(order)
    assert orders[0] != orders[1]  # a new order each epoch
    assert [len(s) for s in samplers] == [4, 3, 3]


def test_reads_are_whole_chunks_aligned_to_the_file(mnist_h5, monkeypatch):
    reads = []
    original = h5py.Dataset.__getitem__

    def recording(self, selection):
        reads.append((self.name, selection))
        return original(self, selection)

    monkeypatch.setattr(h5py.Dataset, "__getitem__", recording)
    chunks = H5Chunks(mnist_h5.path, "train")
    sampler = ChunkShardSampler(len(chunks), rank=1, world_size=3, seed=5)
    for _ in rebatch(DataLoader(chunks, sampler=sampler, batch_size=None), 64):
        pass
    expected = [("/train/labels", slice(None, 60_000))]  # the labels (1 byte each): once, whole, on open
    for c in sampler.my_chunks():
        part = slice(c * 700, min(c * 700 + 700, 60_000))  # starts on a chunk boundary, covers one chunk
        expected.append(("/train/images", part))
    assert reads == expected


class WhereRead(H5Chunks):
    """Also returns which process read the chunk and which process opened the handle it used."""

    def __getitem__(self, task):
        items = super().__getitem__(task)
        return (*items, torch.tensor([os.getpid(), self._pid]))


def test_the_file_is_opened_lazily_by_each_reading_process(mnist_h5, source):
    chunks = WhereRead(mnist_h5.path, "train", limit=2800)
    assert chunks._file is None  # checking the layout opened and closed it: nothing to inherit
    chunks[(0, None)]  # the parent opens it too (as a rank with --workers 0 would)
    assert chunks._file is not None
    assert pickle.loads(pickle.dumps(chunks))._file is None  # a worker never receives an open handle
    sampler = ChunkShardSampler(len(chunks), 0, 1, seed=5)
    # fork: the workers inherit the parent's open handle, and must not use it
    loader = DataLoader(chunks, sampler=sampler, batch_size=None, num_workers=2, multiprocessing_context="fork")
    pids = set()
    for index, images, labels, (reader, opener) in loader:
        assert reader.item() == opener.item() != os.getpid()  # read in a worker, with a handle it opened
        pids.add(reader.item())
        assert np.array_equal(images.numpy(), source[0][index.numpy()])
        assert np.array_equal(labels.numpy(), source[1][index.numpy()])
    assert len(pids) == 2
