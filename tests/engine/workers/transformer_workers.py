"""Rank bodies and the single-process reference for the distributed-transformer tests.

Each rank builds a Hugging Face GPT-2 from the same seed inside ``smp.model_creation(tensor_parallelism=
True, <SMP transformer settings>)``: ``smp.DistributedModel`` replaces it by
``smp.nn.DistributedTransformerLMHead``. ``prescaled_batch`` false: every rank (SMP's dp = tp x rdp)
takes rows ``[dp_rank*b, (dp_rank+1)*b)`` of the step's global batch; true: the tensor-parallel group
shares rows ``[rdp_rank*b, ...)``. The reference trains the Hugging Face model on the whole batch (the
mean of the data ranks' equal-sized losses).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.engine.workers.train_workers import plain

VOCAB, SEQ = 48, 8
SETTINGS = {"fused_softmax": True, "fused_bias_gelu": False, "attention_in_fp32": False}
"""What SMP's GPT-2 example passes to model_creation (asks for SMP's transformer API)."""


def hf_gpt2(seed: int, dropout: float = 0.0) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=VOCAB, n_positions=16, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout)
    cfg._attn_implementation = "eager"
    return tf.GPT2LMHeadModel(cfg)


def hf_bert(seed: int) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.BertConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=4,
                        vocab_size=VOCAB, max_position_embeddings=16, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    return tf.BertForMaskedLM(cfg)


def hf_neox(seed: int) -> torch.nn.Module:
    import transformers as tf

    from smp2ds.engine.integrations.transformers_compat import rope_config_kwargs

    torch.manual_seed(seed)
    cfg = tf.GPTNeoXConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=4,
                           vocab_size=VOCAB, max_position_embeddings=16,
                           **rope_config_kwargs("gpt_neox", 10000.0, 0.5))  # the installed release's spelling
    cfg._attn_implementation = "eager"
    return tf.GPTNeoXForCausalLM(cfg)


def hf_gptj(seed: int) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.GPTJConfig(n_layer=2, n_embd=16, n_head=4, rotary_dim=2, vocab_size=VOCAB, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "eager"
    return tf.GPTJForCausalLM(cfg)


def hf_gptneo(seed: int) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.GPTNeoConfig(num_layers=2, hidden_size=16, num_heads=4, vocab_size=VOCAB, max_position_embeddings=16,
                          attention_types=[[["global", "local"], 1]], window_size=3, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "eager"
    return tf.GPTNeoForCausalLM(cfg)


def hf_of(phase: dict) -> torch.nn.Module:
    if phase.get("family") == "gptneo":
        return hf_gptneo(phase["seed"])
    if phase.get("family") == "gptj":
        return hf_gptj(phase["seed"])
    if phase.get("family") == "neox":
        return hf_neox(phase["seed"])
    if phase.get("family") == "bert":
        return hf_bert(phase["seed"])
    return hf_gpt2(phase["seed"], phase.get("dropout", 0.0))


def to_hf_names(phase: dict, sd: dict) -> dict:
    from smp2ds.engine.nn.huggingface.bert import translate_state_dict_to_hf_bert
    from smp2ds.engine.nn.huggingface.gpt2 import translate_state_dict_to_hf_gpt2
    from smp2ds.engine.nn.huggingface.gptneox import translate_state_dict_to_hf_gptneox

    if phase.get("family") == "neox":
        return translate_state_dict_to_hf_gptneox(sd, num_attention_heads=4)
    if phase.get("family") == "gptneo":
        from smp2ds.engine.nn.huggingface.gptneo import translate_state_dict_to_hf_gptneo

        return translate_state_dict_to_hf_gptneo(sd)
    if phase.get("family") == "gptj":
        from smp2ds.engine.nn.huggingface.gptj import translate_state_dict_to_hf_gptj

        return translate_state_dict_to_hf_gptj(sd)
    return translate_state_dict_to_hf_bert(sd) if phase.get("family") == "bert" else \
        translate_state_dict_to_hf_gpt2(sd)


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask with some right padding (labels -100 there)."""
    g = torch.Generator().manual_seed(900 + step)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[::3, SEQ - 2:] = 0
    return ids, mask


def labels_of(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ids.masked_fill(mask == 0, -100)


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01, eps=1e-6)


def reference(phase: dict, ranks: int, b: int) -> dict:
    """Single-process Hugging Face GPT-2 on the union of the ranks' batches (equal sizes: mean of means)."""
    model = hf_of(phase)
    opt = make_optimizer(phase["optimizer"], model.parameters())
    losses = []
    for step in range(phase["steps"]):
        ids, mask = batch(step, ranks * b)
        per_rank = [model(input_ids=ids[r * b:(r + 1) * b], attention_mask=mask[r * b:(r + 1) * b],
                          labels=labels_of(ids, mask)[r * b:(r + 1) * b]).loss for r in range(ranks)]
        loss = torch.stack(per_rank).mean()
        losses.append([x.item() for x in per_rank])  # a step's reduce_mean averages over rdp only
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _train(smp: Any, phase: dict, b: int) -> dict:
    with smp.model_creation(tensor_parallelism=True, **{**SETTINGS, **phase.get("settings", {})}):
        net = hf_of(phase)
    model = smp.DistributedModel(net)
    if phase.get("dropout"):
        torch.manual_seed(1000 + smp.rank())  # per-rank streams: only the region's own stream keeps masks equal
    module = model.get_module()
    stack = module.bert.encoder if phase.get("family") == "bert" else module.transformer
    out: dict[str, Any] = {"class": type(module).__name__, "stack": type(stack).__name__,
                           "config_layers": module.config.num_hidden_layers}
    layers = list(stack.seq_layers.children())
    out["layers"] = [type(layer).__name__ for layer in layers]
    if phase.get("activation_checkpointing"):
        for layer in layers:
            smp.set_activation_checkpointing(layer.attention)
            smp.set_activation_checkpointing(layer.output)
    prescaled = bool(smp.state.cfg.prescaled_batch)  # the tensor-parallel group shares its rdp rank's rows
    rank, ranks = (smp.rdp_rank(), smp.rdp_size()) if prescaled else (smp.dp_rank(), smp.dp_size())
    ids, mask = batch(100, ranks * b)
    mine = slice(rank * b, (rank + 1) * b)
    module.eval()
    with torch.no_grad():
        out["logits"] = model(input_ids=ids[mine], attention_mask=mask[mine]).logits
    module.train()
    full = model.state_dict()
    out["shards"] = {n: (p.numel(), full[n].numel()) for n, p in model.named_parameters()}
    opt = smp.DistributedOptimizer(make_optimizer(phase["optimizer"], model.parameters()))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, attention_mask=mask, labels=labels_of(ids, mask))["loss"]
        model.backward(loss)
        return loss

    out["losses"] = []
    for step in range(phase["steps"]):
        ids, mask = batch(step, ranks * b)
        out["losses"].append(train_step(model, ids[mine], mask[mine]).reduce_mean().item())
        opt.step()
        opt.zero_grad()
    out["weights"] = {k: v.clone() for k, v in to_hf_names(phase, model.state_dict()).items()}  # the resume trains on
    out["data_rank"], out["data_ranks"] = rank, ranks
    out["local"] = {k: v.detach().clone() for k, v in model.local_state_dict().items() if torch.is_tensor(v)}
    if phase.get("checkpoint"):
        out["checkpoint"] = _resume(smp, phase, model, opt, train_step, ids[mine], mask[mine])
    return out


def _resume(smp: Any, phase: dict, model: Any, opt: Any, train_step: Any, ids: torch.Tensor,
            mask: torch.Tensor) -> dict:
    """Partial checkpoint (a file per tp rank) -> a freshly replaced model with other weights and a new
    optimizer -> resume: the next step equals the uninterrupted one."""
    import os

    path = os.path.join(os.environ["SMP2DS_TEST_TMPDIR"], "transformer_ckpt")
    smp.save_checkpoint(path, "partial", partial=True, model=model, optimizer=opt)
    smp.barrier()
    train_step(model, ids, mask)
    opt.step()
    uninterrupted = {k: v.detach().clone() for k, v in model.state_dict().items()}
    smp.reset()
    with smp.model_creation(tensor_parallelism=True, **SETTINGS):
        net = hf_of({**phase, "seed": phase["seed"] + 1000})
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(make_optimizer(phase["optimizer"], model.parameters()))
    smp.resume_from_checkpoint(path, tag="partial", partial=True)

    @smp.step
    def step_again(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, attention_mask=mask, labels=labels_of(ids, mask))["loss"]
        model.backward(loss)
        return loss

    step_again(model, ids, mask)
    opt.step()
    return {"uninterrupted": uninterrupted, "resumed": model.state_dict(),
            "files": sorted(os.listdir(os.path.join(path, "partial_partial")))}


def run(config: dict, phases: list[dict], b: int) -> list[dict]:
    """Initialise SMP once and train one freshly replaced GPT-2 per phase."""
    import smdistributed.modelparallel.torch as smp

    smp.init(config)
    results = []
    for phase in phases:
        smp.reset()
        results.append(_train(smp, phase, b))
    smp.barrier()
    return plain(results)


def pipeline_refusal() -> str:
    """The message a BERT encoder replaced by SMP's DistributedTransformer gets with
    pipeline_parallel_degree 2 (not implemented; the causal LM heads are pipelined)."""
    import smdistributed.modelparallel.torch as smp

    smp.init({"ddp": True, "pipeline_parallel_degree": 2, "microbatches": 2})
    with smp.model_creation(tensor_parallelism=True, **SETTINGS):
        net = hf_bert(0)
    try:
        smp.DistributedModel(net)
    except Exception as exc:  # noqa: BLE001 - the message goes to the test
        return f"{type(exc).__name__}: {exc}"
    finally:
        smp.barrier()
    return "no error"
