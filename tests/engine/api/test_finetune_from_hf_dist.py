"""Fine-tuning Hugging Face weights with SMP's distributed transformer, the way SMP's public GPT scripts do
(real processes, gloo; see ``finetune_workers``): ``fullmodel.pt`` saved from ``from_pretrained(...).state_dict()``,
the model built with Hugging Face's init skipped inside ``smp.model_creation(tensor_parallelism=True, ...)`` with
the scripts' transformer settings (replaced by ``DistributedTransformerLMHead``, or for BERT its encoder by
``DistributedTransformer``), ``smp.resume_from_checkpoint(dir, tag="fullmodel.pt", partial=False)``, training, then
``smp.save_checkpoint(..., partial=False)`` and ``save_pretrained``.

* lr 0: the full checkpoint and the ``save_pretrained`` directory equal the pretrained state dict, name by name;
* lr > 0: losses and saved weights equal single-process Hugging Face fine-tuning from the same weights;
* the ``save_pretrained`` directory loads with ``from_pretrained`` and gives the distributed model's logits.

Families: GPT-2, GPT-NeoX, GPT-J, GPT-Neo and BERT, tied and untied heads; layouts tp 1 (dp 2), tp 2, tp 4,
tp 2 x pp 2 and tp 2 x sdp 2 with delayed (without sdp: the Hugging Face model built on the meta device) and eager
initialisation.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks
from tests.engine.hf_equivalence import close
from tests.engine.workers import finetune_workers as fw

STEPS = 2

LAYOUTS = {
    # id: (world size, SMP parameters, cases)
    "tp1-dp2": (2, {"ddp": True}, [
        {"family": "gpt2", "tie": True, "lr": 0.0}, {"family": "gpt_neox", "tie": False, "lr": 0.01}]),
    "tp2": (2, {"ddp": True, "tensor_parallel_degree": 2}, [
        {"family": "gpt2", "tie": False, "lr": 0.01}, {"family": "gpt_neox", "tie": True, "lr": 0.0},
        {"family": "gptj", "tie": False, "lr": 0.01}, {"family": "gpt_neo", "tie": True, "lr": 0.0},
        {"family": "bert", "tie": True, "lr": 0.0}, {"family": "bert", "tie": False, "lr": 0.01},
        {"family": "gpt2", "tie": False, "lr": 0.01, "delayed": True}]),
    "tp4": (4, {"ddp": True, "tensor_parallel_degree": 4}, [{"family": "gpt2", "tie": True, "lr": 0.01}]),
    "tp2-pp2": (4, {"ddp": True, "tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "microbatches": 2}, [
        {"family": "gpt2", "tie": True, "lr": 0.0}, {"family": "gpt_neox", "tie": False, "lr": 0.01, "delayed": True}]),
    # the tensor-parallel pair shares its batch (prescaled_batch, SMP's rule with sdp); no clipping: the
    # reference does not clip
    "tp2-sdp2": (4, {"ddp": True, "tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2,
                     "prescaled_batch": True, "sdp_gradient_clipping": 0.0, "delayed_parameter_initialization": True},
                 [{"family": "gptj", "tie": False, "lr": 0.0, "delayed": True},
                  {"family": "gpt_neo", "tie": True, "lr": 0.01, "delayed": True},
                  {"family": "gpt2", "tie": True, "lr": 0.01, "delayed": False}]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fine_tuning_from_hugging_face_weights_round_trips_and_equals_hugging_face(layout, tmp_path):
    world, config, cases = LAYOUTS[layout]
    per_rank = run_ranks(fw.run_fine_tune, world, config, cases, STEPS)
    for i, case in enumerate(cases):
        ref = fw.reference(case["family"], fw.pretrained(case["family"], case["tie"], str(tmp_path)), STEPS,
                           case["lr"])
        want = ref["pretrained"] if case["lr"] == 0 else ref["weights"]
        exact = case["lr"] == 0  # nothing moves: names and values must survive both translations exactly
        for rank, results in enumerate(per_rank):
            got, what = results[i], f"{layout} rank {rank} {case}"
            replaced = "DistributedTransformer" if case["family"] == "bert" else "DistributedTransformerLMHead"
            assert replaced in got["distributed"], (what, got["distributed"])
            close(got["losses"], ref["losses"], f"{what}: losses")
            for source in ("full", "saved_pretrained"):
                assert set(got[source]) == set(want), (what, source, sorted(set(got[source]) ^ set(want)))
                for key, value in want.items():
                    if exact:
                        torch.testing.assert_close(torch.as_tensor(got[source][key]), value, rtol=0, atol=0,
                                                   msg=lambda m, key=key, s=source, w=what: f"{w}: {s} {key}: {m}")
                    else:
                        close(got[source][key], value, f"{what}: {source} {key}")
            close(got["saved_pretrained_logits"], got["logits"], f"{what}: logits of the saved directory")


@pytest.mark.slow
def test_delayed_initialisation_builds_on_meta_and_equals_the_eager_build():
    """delayed_parameter_initialization without sharded data parallelism: the Hugging Face model SMP's
    distributed transformer replaces is built on the meta device, each rank materialises only its shards, and
    the result is bit-identical to the eager build (the same fresh weights: Hugging Face's init skipped)."""
    families, config = ["gpt2", "gpt_neox"], {"ddp": True, "tensor_parallel_degree": 2}
    eager = run_ranks(fw.run_delayed_creation, 2, config, families, False)
    delayed = run_ranks(fw.run_delayed_creation, 2, config, families, True)
    for rank in range(2):
        for i, family in enumerate(families):
            got, want = delayed[rank][i], eager[rank][i]
            assert got["meta"] and not want["meta"], family
            assert got["held_bytes"] == want["held_bytes"], family
            assert set(got["state"]) == set(want["state"])
            for key, value in want["state"].items():
                torch.testing.assert_close(torch.as_tensor(got["state"][key]), torch.as_tensor(value), rtol=0,
                                           atol=0, msg=lambda m, key=key, f=family: f"{f} {key}: {m}")
