"""The device binding of our process groups, with torch.cuda faked (no GPU here): a rank that
never chose a device moves to LOCAL_RANK before the first group exists, a chosen device is
kept, and new groups get device_id where dist.new_group takes it. On gloo nothing changes."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from easy_context.core.groups import group_device, group_for, release_groups


class FakeCuda:
    def __init__(self, monkeypatch, current=0, count=8):
        self.current, self.set_calls = current, []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)

    def set_device(self, index):
        self.set_calls.append(index)
        self.current = index


@pytest.fixture
def nccl(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setenv("LOCAL_RANK", "3")
    release_groups()
    yield monkeypatch
    release_groups()


def test_a_rank_that_never_chose_a_device_moves_to_local_rank(nccl):
    cuda = FakeCuda(nccl, current=0)
    assert group_device() == torch.device("cuda", 3) and cuda.set_calls == [3]


def test_a_chosen_device_is_kept(nccl):
    cuda = FakeCuda(nccl, current=5)
    assert group_device() == torch.device("cuda", 5) and cuda.set_calls == []


@pytest.mark.parametrize("local_rank,count", [("0", 8), ("3", 1), ("", 8)])
def test_device_zero_stays_when_it_is_this_ranks(nccl, local_rank, count):
    """LOCAL_RANK 0; one visible GPU per process (LOCAL_RANK is then no device index); no LOCAL_RANK."""
    nccl.setenv("LOCAL_RANK", local_rank)
    cuda = FakeCuda(nccl, current=0, count=count)
    assert group_device() == torch.device("cuda", 0) and cuda.set_calls == []


def test_the_default_groups_bound_device_wins_over_local_rank(nccl):
    cuda = FakeCuda(nccl, current=0)
    nccl.setattr(dist, "group", SimpleNamespace(WORLD=SimpleNamespace(bound_device_id=torch.device("cuda", 6))))
    assert group_device() == torch.device("cuda", 6) and cuda.set_calls == [6]


def test_gloo_and_no_cuda_change_nothing(nccl):
    cuda = FakeCuda(nccl, current=0)
    nccl.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert group_device() is None
    nccl.setattr(dist, "get_backend", lambda group=None: "nccl")
    nccl.setattr(torch.cuda, "is_available", lambda: False)
    assert group_device() is None and cuda.set_calls == []


def _group_calls(nccl, takes_device_id):
    calls = []

    def with_device_id(ranks, timeout=None, backend=None, device_id=None):
        calls.append(device_id)
        return object()

    def without_device_id(ranks, timeout=None, backend=None):
        calls.append("no device_id")
        return object()

    nccl.setattr(dist, "get_world_size", lambda group=None: 4)
    nccl.setattr(dist, "new_group", with_device_id if takes_device_id else without_device_id)
    first = group_for([2, 3])
    assert group_for([3, 2]) is first and group_for((2, 3)) is first  # one group per rank list
    return calls


def test_new_groups_are_bound_where_new_group_takes_device_id(nccl):
    cuda = FakeCuda(nccl, current=0)
    assert _group_calls(nccl, takes_device_id=True) == [torch.device("cuda", 3)]
    assert cuda.set_calls == [3]  # before the group was created


def test_new_groups_without_device_id_support(nccl):
    FakeCuda(nccl, current=0)
    assert _group_calls(nccl, takes_device_id=False) == ["no device_id"]


def test_gloo_groups_get_no_device_id(nccl):
    FakeCuda(nccl, current=0)
    nccl.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert _group_calls(nccl, takes_device_id=True) == [None]
