"""Rank bodies and single-process references for the tensor-parallel tests.

Models: a tiny GPT-2 / LLaMA / BERT built inside ``smp.model_creation(tensor_parallelism=True)``
(Hugging Face blocks sharded in place, weights kept: every rank builds them from the same seed), and
an MLP built inside ``smp.tensor_parallelism()`` (its ``nn.Linear`` layers become
``smp.nn.DistributedLinear``, keeping the weights they were built with; the run then loads the reference's full
state dict, which the engine cuts into shards). ``smp.nn`` modules built directly draw fresh weights from
``tensor_parallel_seed``.

Data: ``prescaled_batch`` false: every rank of SMP's data-parallel group (tp x rdp ranks) takes rows
``[dp_rank*b, (dp_rank+1)*b)`` of the step's global batch. True: the tensor-parallel group shares
rows ``[rdp_rank*b, ...)``. The reference trains on the union (mean over the ranks' losses).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tests.engine.workers.train_workers import plain

VOCAB, SEQ = 64, 8


def hf_model(family: str, seed: int, dropout: float = 0.0) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=VOCAB, n_positions=32, resid_pdrop=dropout,
                            embd_pdrop=dropout, attn_pdrop=dropout)
        cls = tf.GPT2LMHeadModel
    elif family == "llama":
        cfg = tf.LlamaConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32)
        cls = tf.LlamaForCausalLM
    elif family == "bert":
        cfg = tf.BertConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=4,
                            vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
        cls = tf.BertForMaskedLM
    elif family == "gpt_neox":
        cfg = tf.GPTNeoXConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=4,
                               vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout=0.0,
                               attention_dropout=0.0)
        cls = tf.GPTNeoXForCausalLM
    elif family == "mistral":
        cfg = tf.MistralConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32)
        cls = tf.MistralForCausalLM
    elif family == "roberta":
        cfg = tf.RobertaConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=4,
                               vocab_size=VOCAB, max_position_embeddings=40, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0)
        cls = tf.RobertaForMaskedLM
    elif family == "gptj":
        cfg = tf.GPTJConfig(n_layer=2, n_embd=16, n_head=4, rotary_dim=4, vocab_size=VOCAB, n_positions=32,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cls = tf.GPTJForCausalLM
    elif family == "gpt_neo":
        cfg = tf.GPTNeoConfig(num_layers=2, hidden_size=16, num_heads=4, attention_types=[[["global", "local"], 1]],
                              window_size=4, vocab_size=VOCAB, max_position_embeddings=32, resid_dropout=0.0,
                              embed_dropout=0.0, attention_dropout=0.0)
        cls = tf.GPTNeoForCausalLM
    else:
        raise ValueError(family)
    cfg._attn_implementation = "eager"
    return cls(cfg)


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(ids) + self.down(torch.tanh(self.up(self.emb(ids)))))
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def plain_model(kind: str, seed: int) -> torch.nn.Module:
    if kind == "mlp":
        torch.manual_seed(seed)
        return MLP()
    return hf_model(kind, seed)


def loss_of(kind: str, model: Any, ids: torch.Tensor) -> torch.Tensor:
    if kind == "mlp":
        return model(ids, ids.roll(1, dims=1))
    if kind in ("bert", "roberta"):
        return model(input_ids=ids, labels=ids).loss
    # no key/value cache: a checkpointed block that recomputes would append to it a second time
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def global_ids(step: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (rows, SEQ), generator=g)


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01, eps=1e-6)


def reference(phase: dict, data_ranks: int, b: int) -> dict:
    """Single-process training on the union of the data-parallel ranks' batches."""
    kind = phase["model"]
    model = plain_model(kind, phase["seed"])
    opt = make_optimizer(phase["optimizer"], model.parameters())
    losses, norms = [], []
    for step in range(phase["steps"]):
        ids = global_ids(step, data_ranks * b)
        per_rank = [loss_of(kind, model, ids[r * b:(r + 1) * b]) for r in range(data_ranks)]
        losses.append([x.item() for x in per_rank])
        torch.stack(per_rank).mean().backward()
        if phase.get("clip"):
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), phase["clip"])))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _train(smp: Any, phase: dict, b: int) -> dict:
    kind = phase["model"]
    prescaled = bool(smp.state.cfg.prescaled_batch)
    fresh = fresh_smp_nn_shards(smp) if kind == "mlp" else None
    if kind == "mlp":
        torch.manual_seed(phase["seed"])
        with smp.tensor_parallelism():
            net = MLP()
    else:
        with smp.model_creation(tensor_parallelism=True):
            net = hf_model(kind, phase["seed"], phase.get("dropout", 0.0))
    model = smp.DistributedModel(net)
    if phase.get("dropout"):
        torch.manual_seed(1234 + smp.rank())  # scripts often seed per rank: regions must not follow that
    out: dict[str, Any] = {"report": dict(vars(net._smp2ds_tp_report))}
    if phase.get("activation_checkpointing"):
        for name in out["report"]["sharded_blocks"]:
            smp.set_activation_checkpointing(net.get_submodule(name))
    if kind == "mlp":
        out["kept"], out["fresh"] = _copy(model.state_dict()), fresh
        model.load_state_dict(plain_model(kind, phase["seed"]).state_dict())
    full = model.state_dict()
    out["shards"] = {n: (p.numel(), full[n].numel()) for n, p in model.named_parameters()}
    opt = smp.DistributedOptimizer(make_optimizer(phase["optimizer"], model.parameters()))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        loss = loss_of(kind, model, ids)
        model.backward(loss)
        return loss

    data_rank, data_ranks = (smp.rdp_rank(), smp.rdp_size()) if prescaled else (smp.dp_rank(), smp.dp_size())
    out["losses"], out["norms"] = [], []
    for step in range(phase["steps"]):
        ids = global_ids(step, data_ranks * b)[data_rank * b:(data_rank + 1) * b]
        out["losses"].append(train_step(model, ids).reduce_mean().item())
        if phase.get("clip"):
            out["norms"].append(float(opt.clip_master_grads(phase["clip"])))
        opt.step()
        opt.zero_grad()
    out["weights"] = _copy(model.state_dict())  # copies: the checkpoint phase trains on
    out["local"] = _copy(model.local_state_dict())
    out["data_rank"], out["data_ranks"] = data_rank, data_ranks
    if phase.get("checkpoint"):
        out["checkpoint"] = _checkpoint_round_trip(smp, phase, model, opt, train_step, data_rank, data_ranks, b)
    return out


def _copy(sd: dict) -> dict:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def _checkpoint_round_trip(smp: Any, phase: dict, model: Any, opt: Any, train_step: Any, data_rank: int,
                           data_ranks: int, b: int) -> dict:
    """Partial checkpoint (one file per tp rank) -> fresh model and optimizer -> resume: the next step
    equals the uninterrupted one. Also writes a full checkpoint for the test to load at tp 1."""
    import os

    kind, path = phase["model"], os.path.join(os.environ["SMP2DS_TEST_TMPDIR"], "tp_ckpt")
    smp.save_checkpoint(path, "partial", partial=True, model=model, optimizer=opt)
    smp.save_checkpoint(path, "full", partial=False, model=model)
    smp.barrier()
    full = {k: v for k, v in torch.load(os.path.join(path, "full"), weights_only=False).items()
            if not k.startswith("_smp")}
    plain_tp1 = hf_model(kind, phase["seed"] + 2000)  # a plain model: what tensor_parallel_degree 1 loads
    plain_tp1.load_state_dict(full, strict=True)
    at_tp1 = plain_tp1.state_dict()
    ids = global_ids(phase["steps"], data_ranks * b)[data_rank * b:(data_rank + 1) * b]
    train_step(model, ids)
    opt.step()
    uninterrupted = _copy(model.state_dict())
    smp.reset()
    with smp.model_creation(tensor_parallelism=True):
        net = hf_model(kind, phase["seed"] + 1000)  # other weights: the checkpoint must replace them
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(make_optimizer(phase["optimizer"], model.parameters()))
    smp.resume_from_checkpoint(path, tag="partial", partial=True)

    @smp.step
    def step_again(model: Any, ids: torch.Tensor) -> torch.Tensor:
        loss = loss_of(kind, model, ids)
        model.backward(loss)
        return loss

    step_again(model, ids)
    opt.step()
    files = sorted(os.listdir(os.path.join(path, "partial_partial")))
    return {"uninterrupted": uninterrupted, "resumed": model.state_dict(), "files": files, "full_at_tp1": at_tp1}


def run_tensor_parallel(config: dict, phases: list[dict], b: int) -> list[dict]:
    """Initialise SMP once and train one fresh model per phase."""
    import smdistributed.modelparallel.torch as smp

    smp.init(config)
    results = []
    for phase in phases:
        smp.reset()
        results.append(_train(smp, phase, b))
    results.append({"ranks": {"tp": (smp.tp_rank(), smp.tp_size()), "rdp": (smp.rdp_rank(), smp.rdp_size()),
                              "dp": (smp.dp_rank(), smp.dp_size()), "tp_group": smp.get_tp_group(),
                              "rdp_group": smp.get_rdp_group()}})
    smp.barrier()
    return plain(results)


def fresh_smp_nn_shards(smp: Any) -> dict[str, torch.Tensor]:
    """This rank's shards of the MLP's layers built directly from ``smp.nn`` (fresh weights from
    ``tensor_parallel_seed``'s stream, in creation order), before anything else of the phase draws from it."""
    layers = {"emb": smp.nn.DistributedEmbedding(VOCAB, 16), "up": smp.nn.DistributedLinear(16, 32),
              "down": smp.nn.DistributedLinear(32, 16), "head": smp.nn.DistributedLinear(16, VOCAB)}
    return {f"{name}.{p}": t.detach().clone() for name, layer in layers.items() for p, t in layer.named_parameters()}


def fresh_mlp_weights(seed: int) -> dict[str, torch.Tensor]:
    """The full weights smp.nn gives the MLP's replaced modules (creation order: emb, up, down, head)."""
    import math as _math

    out: dict[str, torch.Tensor] = {}
    for k, (name, shape) in enumerate([("emb", (VOCAB, 16)), ("up", (32, 16)), ("down", (16, 32)),
                                       ("head", (VOCAB, 16))]):
        gen = torch.Generator().manual_seed(seed + k)
        w = torch.empty(shape)
        if name == "emb":
            torch.nn.init.normal_(w, std=0.02, generator=gen)
        else:
            torch.nn.init.kaiming_uniform_(w, a=_math.sqrt(5), generator=gen)
            bias = torch.empty(shape[0])
            torch.nn.init.uniform_(bias, -1 / _math.sqrt(shape[1]), 1 / _math.sqrt(shape[1]), generator=gen)
            out[f"{name}.bias"] = bias
        out[f"{name}.weight"] = w
    return out


def run_refusals() -> dict:
    """What tensor parallelism refuses, with the message each refusal gives (tp 2 on 2 ranks)."""
    import transformers as tf

    import smdistributed.modelparallel.torch as smp

    smp.init({"ddp": True, "tensor_parallel_degree": 2})
    out: dict[str, str] = {}

    def message(fn: Any) -> str:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the message is the result
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    def odd_heads() -> None:
        cfg = tf.GPT2Config(n_layer=1, n_embd=12, n_head=3, vocab_size=VOCAB, n_positions=32)
        with smp.model_creation(tensor_parallelism=True):
            net = tf.GPT2LMHeadModel(cfg)
        smp.DistributedModel(net)

    out["heads"] = message(odd_heads)
    smp.reset()
    out["max_norm"] = message(lambda: smp.nn.DistributedEmbedding(VOCAB, 16, max_norm=1.0))
    smp.reset()
    with smp.tensor_parallelism():
        net = MLP()
    model = smp.DistributedModel(net)
    smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        loss = loss_of("mlp", model, ids)
        model.backward(loss)
        return loss

    rows = 4 if smp.rank() == 0 else 2
    out["batches"] = message(lambda: train_step(model, global_ids(0, rows)))
    smp.barrier()
    return out
