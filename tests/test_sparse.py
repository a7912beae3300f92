"""Sparse tensors in a training step are refused by name: remat plans dense tensors, whose
bytes it counts (a sparse embedding gradient used to fail deep inside the graph builder)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.errors import TraceError


@pytest.mark.parametrize("kind", ["embedding", "embedding_bag"])
def test_a_sparse_embedding_is_refused_with_the_module_and_the_setting_named(kind):
    torch.manual_seed(0)
    table = nn.Embedding(100, 16, sparse=True) if kind == "embedding" else nn.EmbeddingBag(100, 16, sparse=True)
    model = nn.Sequential(table, nn.Linear(16, 3))
    ids, y = torch.randint(0, 100, (8, 4)), torch.randint(0, 3, (8,))
    loss_fn = lambda m, x, y: F.cross_entropy(m(x).reshape(8, -1, 3).mean(1), y)  # noqa: E731
    loss_fn(model, ids, y).backward()  # (eager trains it)
    kind_name = type(table).__name__
    with pytest.raises(TraceError, match=f"module '0' \\({kind_name}\\) has sparse=True, so it makes a "
                                         "torch.sparse_coo tensor in the training step \\(node .*\\); remat plans "
                                         "dense tensors only.*set sparse=False"):
        remat.optimize(model, (ids, y), loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
    table.sparse = False  # the remedy plans
    step = remat.optimize(model, (ids, y), loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
    from remat.verify import check_step

    assert check_step(step, loss_fn, ids, y).bitwise


def test_a_sparse_tensor_made_outside_a_module_is_refused_with_the_node_named():
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(100, 16))
    model = nn.ParameterList([weight])
    ids = torch.randint(0, 100, (8, 4))
    loss_fn = lambda m, ids: F.embedding(ids, m[0], sparse=True).square().mean()  # noqa: E731
    with pytest.raises(TraceError, match="model ParameterList makes a torch.sparse_coo tensor in the training step "
                                         "\\(node .*\\); remat plans dense tensors only.*compute it with dense"):
        remat.optimize(model, (ids,), loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
