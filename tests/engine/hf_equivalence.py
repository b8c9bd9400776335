"""The check the distributed-transformer family tests share: a replaced model and the Hugging Face
model it replaced, called alike with labels, give the same logits (on unmasked positions), loss and
gradients (the reference's gradients translated to SMP's names by ``translate``)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def assert_same_logits_loss_and_gradients(new: torch.nn.Module, ref: torch.nn.Module, ids: torch.Tensor,
                                          mask: torch.Tensor, translate: Callable[[dict], dict]) -> None:
    got = new(input_ids=ids, attention_mask=mask, labels=ids)
    want = ref(input_ids=ids, attention_mask=mask, labels=ids)
    keep = mask.bool()
    assert torch.allclose(got.logits[keep], want.logits[keep], atol=1e-5, rtol=0)
    assert torch.allclose(got.loss, want.loss, atol=1e-6)
    got.loss.backward()
    want.loss.backward()
    ref_grads = translate({n: p.grad for n, p in ref.named_parameters()})
    for name, p in new.named_parameters():
        assert torch.allclose(p.grad, ref_grads[name], atol=1e-6, rtol=1e-5), name


def assert_same_state(got: dict, want: dict) -> None:
    """Two state dicts with the same keys and bit-identical tensors (a translator's exact round trip)."""
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    unequal = [k for k in want if not torch.equal(got[k], want[k])]
    assert not unequal, unequal
