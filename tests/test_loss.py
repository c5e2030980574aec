"""cp_cross_entropy: value = the single-process mean, gradients sum to the single-process gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_distributed
from utils import assert_close

from cp_rope.parallel import cp_cross_entropy


def _data(t: int, v: int, seed: int, ignore_frac: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, v, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, v, (t,), generator=g)
    labels[torch.rand(t, generator=g) < ignore_frac] = -100
    return logits, labels


def test_single_process_equals_mean_ce():
    logits, labels = _data(57, 13, seed=0)
    x = logits.clone().requires_grad_()
    loss = cp_cross_entropy(x, labels)
    loss.backward()
    y = logits.clone().requires_grad_()
    ref = F.cross_entropy(y, labels, ignore_index=-100)
    ref.backward()
    assert loss.dtype == torch.float64
    assert_close(loss.detach().reshape(1), ref.detach().reshape(1), name="loss")
    assert_close(x.grad, y.grad, name="dlogits")


def test_custom_ignore_index_and_low_precision_logits():
    logits, labels = _data(40, 11, seed=1)
    labels[labels == -100] = 7
    keep = torch.arange(40) % 3 != 0
    labels[~keep] = -1
    x = logits.to(torch.bfloat16).requires_grad_()
    loss = cp_cross_entropy(x, labels, ignore_index=-1)
    assert loss.dtype == torch.float32  # computed in (at least) float32
    ref = F.cross_entropy(logits.to(torch.bfloat16).double(), labels, ignore_index=-1)
    assert_close(loss.detach().double().reshape(1), ref.reshape(1), dtype=torch.float32, name="loss")


def test_all_ignored_gives_zero_loss_and_exact_zero_grad():
    logits, _ = _data(9, 5, seed=2)
    x = logits.clone().requires_grad_()
    loss = cp_cross_entropy(x, torch.full((9,), -100))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(x.grad) == 0 and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("logits, labels, exc, name", [
    (torch.randn(4), torch.zeros(4, dtype=torch.long), ValueError, "logits"),
    (torch.randn(4, 3), torch.zeros(5, dtype=torch.long), ValueError, "labels"),
    (torch.randn(4, 3), torch.zeros(4), TypeError, "labels"),
    (torch.zeros(4, 3, dtype=torch.long), torch.zeros(4, dtype=torch.long), TypeError, "logits"),
])
def test_bad_input_names_the_argument(logits, labels, exc, name):
    with pytest.raises(exc, match=name):
        cp_cross_entropy(logits, labels)


def _group_body(rank: int, world: int) -> None:
    # Uneven split of one global batch: rank 0 holds 1 row whose label is real, rank 1 the other
    # 53 rows; the mean and gradient must be the global ones.
    logits, labels = _data(54, 17, seed=3)
    labels[0] = 4
    labels[1:4] = torch.tensor([-100, 2, -100])
    bounds = [0, 1, 54]
    x = logits.clone().requires_grad_()
    ref = F.cross_entropy(x, labels, ignore_index=-100)
    ref.backward()
    lo, hi = bounds[rank], bounds[rank + 1]
    mine = logits[lo:hi].clone().requires_grad_()
    loss = cp_cross_entropy(mine, labels[lo:hi], group=None)
    loss.backward()
    assert_close(loss.detach().reshape(1), ref.detach().reshape(1), name=f"loss rank {rank}")
    # Each rank's gradient is its rows of the global-mean gradient (no 1/world, no local mean).
    assert_close(mine.grad, x.grad[lo:hi], name=f"dlogits rank {rank}")
    # All labels of the group ignored: 0 and exact zeros everywhere, no NaN from 0/0.
    none = logits[lo:hi].clone().requires_grad_()
    zero = cp_cross_entropy(none, torch.full((hi - lo,), -100), group=dist.group.WORLD)
    zero.backward()
    assert zero.item() == 0.0 and torch.count_nonzero(none.grad) == 0


def test_group_mean_and_gradient_shares():
    run_distributed(_group_body, 2)


# ------------------------------------------------------------------ bad input (the issue-15 catalogue)

def test_cross_entropy_labels_out_of_range():
    logits = torch.randn(6, 10)
    with pytest.raises(ValueError, match=r"labels.*\[0, 10\)"):
        cp_cross_entropy(logits, torch.tensor([1, 2, -100, 10, 3, 4]))


def test_cross_entropy_logits_wrong_type():
    with pytest.raises(TypeError, match=r"logits must be a torch.Tensor"):
        cp_cross_entropy(np.zeros((4, 10), np.float32), torch.zeros(4, dtype=torch.long))


def test_cross_entropy_labels_on_another_device():
    with pytest.raises(ValueError, match=r"labels.*device"):
        cp_cross_entropy(torch.randn(4, 10), torch.zeros(4, dtype=torch.long, device="meta"))
