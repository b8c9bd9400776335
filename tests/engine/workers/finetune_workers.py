"""Rank bodies for fine-tuning Hugging Face weights with SMP's distributed transformer, the way SMP's public
GPT scripts do (``--fine_tune 1``, ``--save_final_full_model 1``):

1. rank 0 saves the pretrained model's ``state_dict()`` as ``model_dir/fullmodel.pt`` (Hugging Face's names);
2. every rank skips Hugging Face's init (``PreTrainedModel.init_weights = lambda x: None``), builds the model
   inside ``smp.model_creation(tensor_parallelism=True, ...)`` with the scripts' transformer settings (SMP
   replaces it by ``DistributedTransformerLMHead``) and wraps it;
3. ``smp.resume_from_checkpoint(model_dir, tag="fullmodel.pt", partial=False)``;
4. a few AdamW steps;
5. ``smp.save_checkpoint(model_dir, "final.pt", partial=False, model=model)`` and ``model.save_pretrained``.

:func:`reference` is single-process Hugging Face fine-tuning from the same weights.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.engine.hf_equivalence import fine_tune

VOCAB, SEQ, ROWS = 64, 8, 4
SETTINGS = {"distribute_embedding": False, "fused_softmax": True, "fused_bias_gelu": False,
            "attention_in_fp32": False, "flash_attention": True}


def config(family: str, tie: bool = True) -> Any:
    import transformers as tf

    ids = {"bos_token_id": 0, "eos_token_id": 0, "tie_word_embeddings": tie}
    if family == "gpt2":
        return tf.GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0, **ids)
    if family == "gpt_neox":
        return tf.GPTNeoXConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=4, intermediate_size=32,
                                vocab_size=VOCAB, max_position_embeddings=16, hidden_dropout=0.0,
                                attention_dropout=0.0, **ids)
    if family == "gptj":
        return tf.GPTJConfig(n_layer=2, n_embd=16, n_head=4, rotary_dim=4, vocab_size=VOCAB, n_positions=16,
                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids)
    if family == "bert":  # BertForMaskedLM: its encoder becomes SMP's DistributedTransformer
        return tf.BertConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=4, intermediate_size=32,
                             vocab_size=VOCAB, max_position_embeddings=16, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0, tie_word_embeddings=tie)
    if family == "gpt_neo":
        return tf.GPTNeoConfig(num_layers=2, hidden_size=16, num_heads=4, attention_types=[[["global", "local"], 1]],
                               window_size=4, vocab_size=VOCAB, max_position_embeddings=16, resid_dropout=0.0,
                               embed_dropout=0.0, attention_dropout=0.0, **ids)
    raise ValueError(family)


def auto_class(family: str) -> Any:
    import transformers as tf

    return tf.AutoModelForMaskedLM if family == "bert" else tf.AutoModelForCausalLM


def pretrained(family: str, tie: bool, root: str) -> str:
    """A pretrained model directory (``save_pretrained``), as a hub download would be; seeded, so the test's
    reference rebuilds the same one."""
    path = os.path.join(root, f"pretrained-{family}-{'tied' if tie else 'untied'}")
    torch.manual_seed(300)
    model = auto_class(family).from_config(config(family, tie), attn_implementation="eager")
    model.save_pretrained(path)
    return path


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(900 + step))


def _optimizer(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, eps=1e-6, weight_decay=0.0)


def reference(family: str, path: str, steps: int, lr: float) -> dict:
    """Single-process Hugging Face fine-tuning from the pretrained weights."""
    model = auto_class(family).from_pretrained(path, attn_implementation="eager")
    start = {k: v.clone() for k, v in model.state_dict().items()}
    return {"pretrained": start, **fine_tune(model, _optimizer(model.parameters(), lr), batch, steps)}


def run_fine_tune(smp_config: dict, cases: list[dict], steps: int) -> list[dict]:
    """Per case (``family``, ``tie``, ``lr``, ``delayed``): the losses, the full checkpoint written by
    ``save_checkpoint(partial=False)`` and the directory ``save_pretrained`` wrote, read back by Hugging Face
    (its state and its logits against the distributed model's)."""
    from transformers.modeling_utils import PreTrainedModel

    import smdistributed.modelparallel.torch as smp
    from tests.engine.workers.train_workers import plain

    smp.init(smp_config)
    root = os.environ["SMP2DS_TEST_TMPDIR"]
    results = []
    original_init = PreTrainedModel.init_weights
    for i, case in enumerate(cases):
        smp.reset()
        family, tie, lr = case["family"], case["tie"], case["lr"]
        model_dir = os.path.join(root, f"case{i}")
        if smp.rank() == 0:
            os.makedirs(model_dir, exist_ok=True)
            hf = auto_class(family).from_pretrained(pretrained(family, tie, root))
            torch.save(hf.state_dict(), os.path.join(model_dir, "fullmodel.pt"))
        smp.barrier()
        PreTrainedModel.init_weights = lambda self: None  # the scripts' patch: SMP initialises the replacement
        try:
            with smp.model_creation(tensor_parallelism=True, dtype=torch.float32, **SETTINGS), \
                    smp.delay_param_initialization(enabled=case.get("delayed", False)):
                net = auto_class(family).from_config(config(family, tie), attn_implementation="eager")
        finally:
            PreTrainedModel.init_weights = original_init
        model = smp.DistributedModel(net)
        opt = smp.DistributedOptimizer(_optimizer(model.parameters(), lr))
        smp.resume_from_checkpoint(model_dir, tag="fullmodel.pt", partial=False)

        @smp.step
        def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
            loss = model(input_ids=ids, labels=ids)["loss"]
            model.backward(loss)
            return loss

        @smp.step
        def logits_of(model: Any, ids: torch.Tensor) -> torch.Tensor:
            return model(input_ids=ids).logits

        out: dict[str, Any] = {"losses": [], "distributed": sorted(
            {type(m).__name__ for m in model.get_module().modules() if type(m).__name__.startswith("Distributed")})}
        for step in range(steps):
            out["losses"].append(train_step(model, batch(step)).reduce_mean().item())
            opt.step()
            opt.zero_grad()
        smp.save_checkpoint(model_dir, "final.pt", partial=False, model=model)
        model.save_pretrained(os.path.join(model_dir, "hf"))
        model.eval()
        with torch.no_grad():
            out["logits"] = logits_of(model, batch(0)).concat()
        out["full"] = {k: v.clone() for k, v in torch.load(os.path.join(model_dir, "final.pt")).items()}
        reloaded = auto_class(family).from_pretrained(os.path.join(model_dir, "hf"), attn_implementation="eager")
        out["saved_pretrained"] = {k: v.detach().clone() for k, v in reloaded.state_dict().items()}
        with torch.no_grad():
            out["saved_pretrained_logits"] = reloaded(input_ids=batch(0)).logits
        results.append(out)
        smp.barrier()
    return plain(results)


def run_delayed_creation(smp_config: dict, families: list[str], delayed: bool) -> list[dict]:
    """Per family, built as SMP's scripts build it (Hugging Face's init skipped, ``model_creation`` with the
    transformer settings, ``delayed_parameter_initialization`` from the config): whether the Hugging Face model
    was built on the meta device, the bytes of this rank's parameters after wrapping, and the gathered state."""
    from transformers.modeling_utils import PreTrainedModel

    import smdistributed.modelparallel.torch as smp
    from tests.engine.workers.train_workers import plain

    smp.init({**smp_config, "delayed_parameter_initialization": delayed})
    original_init = PreTrainedModel.init_weights
    results = []
    for family in families:
        smp.reset()
        PreTrainedModel.init_weights = lambda self: None
        try:
            with smp.model_creation(tensor_parallelism=True, dtype=torch.float32, **SETTINGS):
                net = auto_class(family).from_config(config(family, True), attn_implementation="eager")
        finally:
            PreTrainedModel.init_weights = original_init
        meta = all(p.is_meta for p in net.parameters())
        model = smp.DistributedModel(net)
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        results.append({"meta": meta, "held_bytes": held, "state": {k: v.clone() for k, v in model.state_dict().items()}})
    return plain(results)
