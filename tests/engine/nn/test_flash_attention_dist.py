"""``flash_attention=True`` at tensor_parallel_degree 2 on 2 real ranks (gloo, DeepSpeed), with
``optimize: speed`` and ``optimize: memory`` (sequence parallelism).

* Hugging Face GPT-2 (activation checkpointing of ``.attention`` / ``.output``), GPT-Neo (a global and a
  local layer), GPT-NeoX, GPT-J and BERT built inside ``smp.model_creation(tensor_parallelism=True,
  flash_attention=True, ...)``: the replaced model's logits equal the Hugging Face model's, and training
  equals single-process Hugging Face training (losses and weights);
* attention dropout on the flash path draws from the tensor-parallel group's stream: with dropout 0.2 and
  different script seeds per rank, the flash model trains exactly like the eager model (CPU: SDPA's math
  kernel draws its mask as ``nn.Dropout`` does from the current generator, so equal streams give equal
  masks), also with activation checkpointing recomputing the attention;
* the flash phases called ``scaled_dot_product_attention`` and the eager ones never did.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._dist import run_ranks
from tests.engine.workers import flash_attention_workers as fw
from tests.engine.workers import transformer_workers as tw

B, TP = 3, 2
FLASH = {"flash_attention": True}
EAGER = {"flash_attention": False}
BASE = {"ddp": True, "tensor_parallel_degree": TP, "tensor_parallel_seed": 3}
DROPOUT = {"optimizer": "sgd", "seed": 7, "steps": 2, "dropout": 0.2, "activation_checkpointing": True}
PHASES = {
    "speed": [
        {"optimizer": "sgd", "seed": 2, "steps": 2, "activation_checkpointing": True, "settings": FLASH},
        {"optimizer": "sgd", "seed": 10, "steps": 2, "family": "gptneo", "settings": FLASH},
        {"optimizer": "sgd", "seed": 8, "steps": 2, "family": "neox", "settings": FLASH},
        {"optimizer": "adamw", "seed": 9, "steps": 2, "family": "gptj", "settings": FLASH},
        {"optimizer": "adamw", "seed": 4, "steps": 2, "family": "bert", "settings": FLASH},
        {**DROPOUT, "settings": FLASH},
        {**DROPOUT, "settings": EAGER},
    ],
    "memory": [
        {"optimizer": "sgd", "seed": 2, "steps": 2, "activation_checkpointing": True, "settings": FLASH},
        {"optimizer": "sgd", "seed": 10, "steps": 2, "family": "gptneo", "settings": FLASH},
        {"optimizer": "adamw", "seed": 4, "steps": 2, "family": "bert", "settings": FLASH},
        {**DROPOUT, "settings": FLASH},
        {**DROPOUT, "settings": EAGER},
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("optimize", list(PHASES))
def test_tp2_flash_attention_equals_hugging_face_and_the_eager_path(optimize):
    phases = PHASES[optimize]
    per_rank = run_ranks(fw.run, TP, {**BASE, "optimize": optimize}, phases, B)
    for p, phase in enumerate(phases):
        calls = [r[p]["sdpa_calls"] for r in per_rank]
        assert [r[p]["optimize"] for r in per_rank] == [optimize] * TP
        if phase["settings"]["flash_attention"]:
            assert min(calls) > 0, calls
        else:
            assert calls == [0] * TP
        if phase.get("dropout"):
            continue
        ranks = per_rank[0][p]["data_ranks"]
        ref = tw.reference(phase, ranks, B)
        ids, mask = tw.batch(100, ranks * B)
        with torch.no_grad():
            want_logits = tw.hf_of(phase).eval()(input_ids=ids, attention_mask=mask).logits
        for rank in range(TP):
            got = per_rank[rank][p]
            r, what = got["data_rank"], f"{optimize} {phase.get('family', 'gpt2')}"
            keep = mask[r * B:(r + 1) * B].bool()
            np.testing.assert_allclose(got["logits"][keep.numpy()], want_logits[r * B:(r + 1) * B][keep].numpy(),
                                       rtol=1e-5, atol=1e-5, err_msg=what)
            np.testing.assert_allclose(got["losses"], [step[r] for step in ref["losses"]], rtol=1e-4, atol=1e-6,
                                       err_msg=what)
            assert set(got["weights"]) == set(ref["weights"])
            for key, want in ref["weights"].items():
                np.testing.assert_allclose(got["weights"][key], want.numpy(), rtol=1e-4, atol=1e-5,
                                           err_msg=f"{what} {key}")
    flash, eager = len(phases) - 2, len(phases) - 1  # the dropout pair: same stream, same masks
    for rank in range(TP):
        got, want = per_rank[rank][flash], per_rank[rank][eager]
        np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5, atol=1e-6)
        for key, value in want["weights"].items():
            np.testing.assert_allclose(got["weights"][key], value, rtol=1e-5, atol=1e-6, err_msg=key)
        initial = tw.hf_of(DROPOUT).state_dict()["transformer.h.0.attn.c_attn.weight"].numpy()
        assert not np.allclose(got["weights"]["transformer.h.0.attn.c_attn.weight"], initial)
