"""The check the distributed-transformer family tests share: a replaced model and the Hugging Face
model it replaced, called alike with labels, give the same logits (on unmasked positions), loss and
gradients (the reference's gradients translated to SMP's names by ``translate``); and the single-process
fine-tuning the pretrained-weights tests compare with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def fine_tune(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any, steps: int) -> dict:
    """Single-process Hugging Face fine-tuning (the reference of the fine-tuning tests): the logits of
    ``batch(0)`` before training, each step's loss on ``batch(step)`` (labels = inputs), the final weights."""
    with torch.no_grad():
        logits = model(input_ids=batch(0)).logits
    losses = []
    for step in range(steps):
        loss = model(input_ids=batch(step), labels=batch(step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"logits": logits, "losses": losses, "weights": model.state_dict()}


def close(got: Any, want: Any, what: str, atol: float = 1e-5) -> None:
    """``got`` equals ``want`` within rtol 1e-4 and ``atol`` (fp32 sums in another order), naming ``what``."""
    torch.testing.assert_close(torch.as_tensor(got).float(), torch.as_tensor(want).float(), rtol=1e-4, atol=atol,
                               msg=lambda m: f"{what}: {m}")
