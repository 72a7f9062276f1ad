import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed

pytestmark = pytest.mark.multirank


def _allreduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    return rank


def test_forked_ranks_communicate():
    # 1 + 2 + 3 + 4 = 10 on every rank
    assert run_distributed(_allreduce, 4) == [10.0] * 4


def test_failure_in_a_rank_is_reported():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_distributed(_fail, 2)
