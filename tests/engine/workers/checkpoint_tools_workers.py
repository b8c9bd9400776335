"""Rank bodies that train tiny models and save partial checkpoints for the ``smp2ds checkpoint`` tests.

Each phase builds a fresh model (``smp.reset()``), trains a few AdamW steps, saves
``smp.save_checkpoint(partial=True)`` under ``<root>/<name>`` (tags ``step1`` and ``step2``) and reports, from rank 0, the model's
full ``state_dict()`` gathered at training time: what consolidation must reproduce bit for bit.
Without pipelining the smp2ds model's own logits on a fixed input are reported too.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.engine.workers import tp_workers as tw
from tests.engine.workers import transformer_workers as trw
from tests.engine.workers.train_workers import plain

PROBE = (torch.arange(2 * tw.SEQ).reshape(2, tw.SEQ) * 7) % min(tw.VOCAB, trw.VOCAB)
"""The fixed input whose logits the export tests compare."""


REPLACED = {"gpt2_replaced": trw.hf_gpt2, "neox_replaced": trw.hf_neox}
"""Models SMP's distributed transformer replaces (smp.nn.DistributedTransformerLMHead), by phase model name."""


def hf_of(model: str, seed: int) -> torch.nn.Module:
    """The Hugging Face model a phase builds (before any replacement)."""
    return REPLACED[model](seed) if model in REPLACED else tw.hf_model(model, seed)


def build(smp: Any, phase: dict) -> torch.nn.Module:
    if phase["model"] in REPLACED:  # as SMP's GPT-2 / GPT-NeoX examples: the distributed transformer
        with smp.model_creation(tensor_parallelism=True, **trw.SETTINGS):
            return REPLACED[phase["model"]](phase["seed"])
    with smp.model_creation(tensor_parallelism=True):
        return tw.hf_model(phase["model"], phase["seed"])


def decay_groups(named: Any) -> list[dict]:
    """Two AdamW groups split by weight decay as SMP's GPT-2 script splits them (biases and layer norms without):
    the same split under Hugging Face's names and the distributed transformer's."""
    decay, no_decay = [], []
    for name, param in named:
        leaf = name.rsplit(".", 1)[-1]
        norm = "layernorm" in name or "layer_norm" in name or "ln_" in name
        (no_decay if leaf == "bias" or norm else decay).append(param)
    return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


def _setup(smp: Any, phase: dict, b: int) -> tuple[Any, Any, Any]:
    """(model, optimizer, run(step): one training step on this rank's rows of the step's batch); ``phase["groups"]``:
    the model starts from the Hugging Face model's weights (loaded in Hugging Face's names) and the optimizer takes
    :func:`decay_groups` (the distributed transformer's names order the groups otherwise than the model's
    parameters)."""
    model = smp.DistributedModel(build(smp, phase))
    if phase.get("groups"):  # fine-tuning, as SMP's script with its own weights: start from the Hugging Face ones
        model.load_state_dict(hf_of(phase["model"], phase["seed"]).state_dict())
    params = decay_groups(model.named_parameters()) if phase.get("groups") else model.parameters()
    opt = smp.DistributedOptimizer(tw.make_optimizer("adamw", params))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        model.backward(loss)
        return loss

    prescaled = bool(smp.state.cfg.prescaled_batch)
    rank, ranks = (smp.rdp_rank(), smp.rdp_size()) if prescaled else (smp.dp_rank(), smp.dp_size())

    def run(step: int) -> None:
        ids = tw.global_ids(step, ranks * b)[rank * b:(rank + 1) * b] % min(tw.VOCAB, trw.VOCAB)
        train_step(model, ids)
        opt.step()
        opt.zero_grad()

    run.data_ranks = ranks  # type: ignore[attr-defined]
    return model, opt, run


def _train(smp: Any, phase: dict, root: str, b: int) -> dict:
    model, opt, run = _setup(smp, phase, b)
    for step in range(phase.get("steps", 2)):
        run(step)
        if step == 0:  # an earlier save beside the final one (the mixed-tags case copies files across)
            smp.save_checkpoint(os.path.join(root, phase["name"]), "step1", partial=True, model=model, optimizer=opt)
    out: dict[str, Any] = {}
    if int(smp.state.cfg.pipeline_parallel_degree) == 1:
        model.get_module().eval()
        with torch.no_grad():
            out["logits"] = model(input_ids=PROBE, use_cache=False).logits.detach().cpu().clone()
        model.get_module().train()
    full = model.state_dict()
    smp.save_checkpoint(os.path.join(root, phase["name"]), "step2", partial=True, model=model, optimizer=opt,
                        user_content={"step": 2})
    smp.barrier()
    if smp.rank() == 0:
        out["state_dict"] = {k: v.detach().cpu().clone() for k, v in full.items() if not k.startswith("_smp")}
    return out


def train_and_save(config: dict, phases: list[dict], root: str, b: int = 2) -> list[dict]:
    """Initialise SMP once; one fresh model per phase, each saved under ``root/<phase name>``."""
    import smdistributed.modelparallel.torch as smp

    smp.init(config)
    results = []
    for phase in phases:
        smp.reset()
        results.append(_train(smp, phase, root, b))
    smp.barrier()
    return plain(results)  # numpy: tensors shared through file descriptors vanish with the worker


def resume_and_train(config: dict, phase: dict, path: str, b: int = 2) -> dict:
    """Another layout: a fresh model (other weights) resumes ``path`` (newest) and trains steps
    ``phase["start"]`` .. ``phase["start"] + phase["steps"] - 1``; rank 0 returns the full weights."""
    import smdistributed.modelparallel.torch as smp

    smp.init(config)
    model, _, run = _setup(smp, {**phase, "seed": phase["seed"] + 1000}, b)  # other weights: resume replaces them
    content = smp.resume_from_checkpoint(path, partial=True)
    for step in range(phase["start"], phase["start"] + phase["steps"]):
        run(step)
    full = model.state_dict()
    smp.barrier()
    out = {"user_content": content, "dp": run.data_ranks}
    if smp.rank() == 0:
        out["state_dict"] = {k: v.detach().cpu().clone() for k, v in full.items() if not k.startswith("_smp")}
    return plain(out)
