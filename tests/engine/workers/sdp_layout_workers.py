"""Rank bodies for SMP's sharded-data-parallel checkpoint layout (``tests/engine/checkpoint_tools/test_smp_sdp_layout_dist.py``).

Written like SMP's GPT-2 example under ``sharded_data_parallel_degree``: AdamW over two parameter groups split
by weight decay, ``smp.save_checkpoint(..., partial=True)`` whose user content holds ``param_shapes`` (the
optimizer's parameters by group, in DeepSpeed's order, named by ``model.module.named_parameters()``) and
``buffer_names``, as that script computes them, and ``smp.resume_from_checkpoint(path)`` of the newest save.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

from tests.engine.workers import tp_workers as tw
from tests.engine.workers import transformer_workers as trw
from tests.engine.workers.train_workers import plain

CONFIG = {"ddp": True, "sharded_data_parallel_degree": 2, "sdp_gradient_clipping": 1.0}
STEPS, SAVE_AT, B = 4, 2, 2
VOCAB = min(tw.VOCAB, trw.VOCAB)


def build(smp: Any, model: str, seed: int) -> torch.nn.Module:
    if model == "gpt2_replaced":  # SMP's distributed transformer, as its GPT-2 example asks for it
        with smp.model_creation(tensor_parallelism=True, **trw.SETTINGS):
            return trw.hf_gpt2(seed)
    return tw.hf_model(model, seed)


def param_groups(model: Any) -> list[dict[str, Any]]:
    """Two groups split by weight decay (biases and layer norms without), as SMP's GPT-2 example builds them."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if name.endswith("bias") or "ln" in name or "layernorm" in name else decay).append(param)
    return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


def param_shapes(model: Any, optimizer: Any) -> list[OrderedDict]:
    """SMP's script's ``get_param_shapes``: per DeepSpeed group, name -> full shape, in the flat partitions' order."""
    names = {param: name for name, param in model.module.named_parameters()}
    return [OrderedDict((names[p], p.ds_shape if hasattr(p, "ds_shape") else p.shape) for p in group)
            for group in optimizer.fp16_groups]


def buffer_names(model: Any) -> list[str]:
    """SMP's script's ``get_buffer_names``: persistent buffers of ``model.module``."""
    out: list[str] = []

    def walk(module: torch.nn.Module, prefix: str) -> None:
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out.append(prefix + name)
        for name, child in module.named_children():
            walk(child, prefix + name + ".")

    walk(model.module, "")
    return out


class _Records(logging.Handler):
    """What the ``smp2ds`` logger says while the model is wrapped."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _setup(smp: Any, model_kind: str, seed: int, before_optimizer: Any = None) -> tuple[Any, Any, Any]:
    records, logger = _Records(), logging.getLogger("smp2ds")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        model = smp.DistributedModel(build(smp, model_kind, seed))
    finally:
        logger.removeHandler(records)
    model.wrap_log = records.lines  # type: ignore[attr-defined]
    if before_optimizer is not None:
        before_optimizer(model)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(param_groups(model), lr=0.01, eps=1e-6))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        model.backward(loss)
        return loss

    def run(step: int) -> float:
        ids = tw.global_ids(step, smp.dp_size() * B)[smp.dp_rank() * B:(smp.dp_rank() + 1) * B] % VOCAB
        loss = train_step(model, ids).reduce_mean()
        opt.step()
        opt.zero_grad()
        return float(loss)

    return model, opt, run


def train_and_save(model_kind: str, root: str, seed: int = 7) -> dict:
    """Train ``STEPS`` steps uninterrupted, saving SMP's sdp checkpoint after ``SAVE_AT`` (tag ``step<n>``) and at
    the end (SMP's final tag); rank 0 returns the losses after the save and the weights then and at the end."""
    import smdistributed.modelparallel.torch as smp

    smp.init(CONFIG)
    model, opt, run = _setup(smp, model_kind, seed)
    losses, out = [], {}
    for step in range(STEPS):
        if step == SAVE_AT:
            out["saved_state_dict"] = model.state_dict()
            smp.save_checkpoint(root, f"step{step}", partial=True, model=model, optimizer=opt,
                                user_content={"total_steps": step, "buffer_names": buffer_names(model),
                                              "param_shapes": param_shapes(model, opt)})
        losses.append(run(step))
    final = model.state_dict()
    smp.save_checkpoint(root, "sharded_data_parallel_final_full_1", partial=True, model=model, optimizer=opt,
                        user_content={"cli_args": {"lr": 0.01}, "total_steps": STEPS, "model_config":
                                      model.get_module().config, "buffer_names": buffer_names(model),
                                      "param_shapes": param_shapes(model, opt)})
    smp.barrier()
    if smp.rank() != 0:
        return {}
    return plain({"losses": losses[SAVE_AT:], "final": dict(final), "wrap_log": model.wrap_log, **out})


def resume_and_train(model_kind: str, path: str, tag: str | None = None) -> dict:
    """A fresh model (other weights) resumes ``path`` and trains the steps after the save; rank 0 returns the
    user content's step, the losses and the final weights."""
    import smdistributed.modelparallel.torch as smp

    smp.init(CONFIG)
    model, _, run = _setup(smp, model_kind, seed=1234)
    content = smp.resume_from_checkpoint(path, tag=tag, partial=True)
    start = int(content["total_steps"])
    losses = [run(step) for step in range(start, STEPS)]
    final = model.state_dict()
    smp.barrier()
    return plain({"start": start, "losses": losses, "final": dict(final)}) if smp.rank() == 0 else {}


def load_before_the_optimizer(model_kind: str) -> dict:
    """A model with other weights is wrapped, then ``model.load_state_dict`` of the weights ``train_and_save``
    starts from (seed 7), before ``smp.DistributedOptimizer`` exists (as scripts load pretrained weights), and
    trains all ``STEPS``; rank 0 returns the losses after ``SAVE_AT`` and the final weights."""
    import smdistributed.modelparallel.torch as smp

    smp.init(CONFIG)
    start = build(smp, model_kind, 7).state_dict()
    model, _, run = _setup(smp, model_kind, seed=1234, before_optimizer=lambda m: m.load_state_dict(start))
    losses = [run(step) for step in range(STEPS)]
    final = model.state_dict()
    smp.barrier()
    return plain({"losses": losses[SAVE_AT:], "final": dict(final)}) if smp.rank() == 0 else {}
