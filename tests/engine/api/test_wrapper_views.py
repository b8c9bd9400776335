"""SMP's wrapper chain behind ``DistributedModel.module`` (``engine/api/wrapper_views.py``) in one process: what
scripts do with it (walk ``.module``, unwrap by ``isinstance``, call it, read the model's attributes through it,
switch modes, copy it). Its place on a real ``DistributedModel`` per layout: ``tests/engine/api/test_api_dist.py``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from smp2ds.engine.api.wrapper_views import Bit16Wrapper, DataParallelWrapper, wrapper_chain


@pytest.mark.parametrize("data_parallel,sixteen_bit,classes", [
    (True, True, [DataParallelWrapper, Bit16Wrapper]), (True, False, [DataParallelWrapper]),
    (False, True, [Bit16Wrapper]), (False, False, [])])
def test_the_chain_holds_the_model_where_smp_did(data_parallel, sixteen_bit, classes):
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    net.custom = "kept"
    outer = wrapper_chain(net, data_parallel=data_parallel, sixteen_bit=sixteen_bit)
    walked, current = [], outer
    while current is not net:
        walked.append(type(current))
        current = current.module
    assert walked == classes
    unwrapped = outer
    while isinstance(unwrapped, (DistributedDataParallel, Bit16Wrapper)):  # the GPT example's loop
        unwrapped = unwrapped.module
    assert unwrapped is net
    x = torch.randn(4, 3)
    assert torch.equal(outer(x), net(x)) and outer.custom == "kept"
    outer.eval()
    assert not net.training and not outer.training
    outer.train()
    assert net.training and outer.training


def test_a_copy_of_the_chain_is_a_copy_of_the_model():
    net = torch.nn.Linear(3, 2)
    copied = copy.deepcopy(wrapper_chain(net, data_parallel=True, sixteen_bit=True))
    assert copied.module.module is not net
    torch.testing.assert_close(copied.module.module.weight, net.weight)
