"""The engine's data loader as a checkpoint sees it: DistributedSampler's order, per-epoch reshuffling without
``set_epoch``, a position that survives ``state_dict``/``load_state_dict`` (also at another world size), and
consumed samples skipped without being loaded. No process group: ranks are simulated by their samplers.
(The end-to-end resume through ``save_checkpoint``/``load_checkpoint`` is in test_checkpoint.py.)"""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler, TensorDataset

from shardspeed.runtime.dataloader import ResumableDataLoader, ResumableDistributedSampler


class CountingDataset(Dataset):
    def __init__(self, n: int):
        self.n = n
        self.loaded = []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.loaded.append(i)
        return torch.tensor(i)


def _loaders(n: int, world: int, batch: int, drop_last: bool = False, dataset=None):
    ds = dataset if dataset is not None else CountingDataset(n)
    return [ResumableDataLoader(ds, batch_size=batch, drop_last=drop_last,
                                sampler=ResumableDistributedSampler(ds, world, r, seed=3, drop_last=drop_last))
            for r in range(world)]


def _take(loader_iters, steps: int):
    """``steps`` batches from every rank (as a training step does); flattened sample ids per rank."""
    return [[int(i) for _ in range(steps) for i in next(it)] for it in loader_iters]


@pytest.mark.parametrize("n,world,drop_last", [(20, 2, False), (21, 4, False), (21, 4, True), (7, 3, False)])
def test_order_is_distributed_samplers(n, world, drop_last):
    ds = TensorDataset(torch.arange(n))
    for epoch in range(3):
        for r in range(world):
            ref = DistributedSampler(ds, world, r, shuffle=True, seed=3, drop_last=drop_last)
            ref.set_epoch(epoch)
            ours = ResumableDistributedSampler(ds, world, r, seed=3, drop_last=drop_last)
            ours.set_epoch(epoch)
            assert list(ours) == list(ref)


def test_epochs_reshuffle_by_themselves_and_set_epoch_is_honoured():
    (dl,) = _loaders(10, 1, 5)
    e0 = [int(i) for b in dl for i in b]
    e1 = [int(i) for b in dl for i in b]
    assert sorted(e0) == sorted(e1) == list(range(10)) and e0 != e1
    assert dl.sampler.epoch == 1
    dl.set_epoch(0)  # another epoch: from its start
    assert [int(i) for b in dl for i in b] == e0
    dl.sampler.set_epoch(1)
    it = iter(dl)
    first = next(it)
    dl.sampler.set_epoch(1)  # the current epoch: its position is kept
    assert [int(i) for b in dl for i in b] == e1[5:] and first.tolist() == e1[:5]


def test_resume_continues_with_the_next_batch_and_skips_without_loading():
    straight = _loaders(20, 2, 3)
    its = [iter(dl) for dl in straight]
    ref = _take(its, 4)  # 7, 7, 6 samples... per rank: batches 3, 3, 3, 1 = one epoch (10 a rank)
    its = [iter(dl) for dl in straight]  # epoch 1
    ref = [a + b for a, b in zip(ref, _take(its, 3))]

    ds = CountingDataset(20)
    first = _loaders(20, 2, 3, dataset=ds)
    its = [iter(dl) for dl in first]
    _take(its, 2)
    state = first[0].state_dict()
    assert state["epoch"] == 0 and state["position"] == 12 and state["world_size"] == 2

    ds2 = CountingDataset(20)
    resumed = _loaders(20, 2, 3, dataset=ds2)
    for dl in resumed:
        dl.load_state_dict(state)
    assert len(resumed[0]) == 2  # batches left in this epoch on each rank: 3 and 1 samples
    got = _take([iter(dl) for dl in resumed], 2)
    got = [a + b for a, b in zip(got, _take([iter(dl) for dl in resumed], 3))]  # the next epoch
    assert got == [r[6:] for r in ref]
    assert sorted(ds2.loaded) == sorted(i for r in got for i in r)  # the first 12 were never loaded


def test_break_and_iterate_again_continues():
    (dl,) = _loaders(12, 1, 4)
    seen = []
    for b in dl:
        seen += b.tolist()
        break
    seen += [i for b in dl for i in b.tolist()]
    assert sorted(seen) == list(range(12))


def test_a_full_epoch_saved_before_the_loop_noticed_starts_the_next():
    (dl,) = _loaders(8, 1, 4)
    it = iter(dl)
    next(it), next(it)  # both batches consumed, the iterator not yet exhausted
    state = dl.state_dict()
    assert state["position"] == 8 and state["epoch"] == 0
    (fresh,) = _loaders(8, 1, 4)
    fresh.load_state_dict(state)
    got = [i for b in fresh for i in b.tolist()]
    assert fresh.sampler.epoch == 1 and sorted(got) == list(range(8))
    assert got == [i for b in dl for i in b.tolist()]  # what the saved run reads next


@pytest.mark.parametrize("world_from,world_to", [(2, 4), (4, 2), (2, 1), (2, 3)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_another_world_size_continues_at_the_same_global_position(world_from, world_to, drop_last):
    n = 24
    before = _loaders(n, world_from, 2, drop_last)
    _take([iter(dl) for dl in before], 2)
    state = before[0].state_dict()
    p = state["position"]
    assert p == 2 * 2 * world_from
    order = before[0].sampler.epoch_order(0)
    after = _loaders(n, world_to, 2, drop_last)
    for dl in after:
        dl.load_state_dict(state)
    rest = [[i for b in dl for i in b.tolist()] for dl in after]
    assert len({len(r) for r in rest}) == 1  # every rank as many samples: no rank waits for another
    dealt = [i for k in range(len(rest[0])) for r in rest for i in [r[k]]]  # round-robin over the ranks
    want = order[p:]
    assert dealt[: len(want)] == want[: len(dealt)]
    if not drop_last:
        assert set(dealt) == set(want)  # nothing of the epoch's rest is lost (padding repeats a few)
    ds = after[0].dataset
    for r, dl in enumerate(after):  # the next epoch is a plain world_to-rank epoch
        ref = DistributedSampler(ds, world_to, r, shuffle=True, seed=3, drop_last=drop_last)
        ref.set_epoch(1)
        assert [i for b in dl for i in b.tolist()][: len(ref) // 2 * 2] == list(ref)[: len(ref) // 2 * 2]
        assert dl.sampler.epoch == 1
