"""GPT-2 (or GPT-Neo, ``--model-type gpt_neo``) pre-training with SMP's distributed transformer, written
the way SMP's GPT-2 example was.

smp.init from arguments; with the distributed transformer, Hugging Face's weight init skipped
(``PreTrainedModel.init_weights = lambda x: None``: "DistributedModel will override those weights
anyway"); a Hugging Face GPT-2 / GPT-Neo built by ``AutoModelForCausalLM.from_config`` inside
``smp.model_creation(tensor_parallelism=smp.tp_size() > 1 or args.use_distributed_transformer > 0,
...)`` with the example's transformer settings (SMP replaces it by
``smp.nn.DistributedTransformerLMHead``, which initialises its own weights); optionally the starting
weights from a Hugging Face state dict through ``translate_hf_state_dict_to_smdistributed_<model>``;
``seq_layers`` partition assignment;
activation checkpointing of every layer's ``.attention`` and ``.output`` (or of ``seq_layers``);
``@smp.step`` with ``model.backward``; at the end a full checkpoint in Hugging Face's names through
``translate_state_dict_to_hf_<model>``, saved by rank 0 and loaded into a plain Hugging Face model.
``--fine-tune 1`` follows SMP's fine-tuning path: rank 0 saves ``from_pretrained(--model-name).state_dict()`` as
``--model-dir``'s ``fullmodel.pt``, every rank resumes from it (``smp.resume_from_checkpoint(..., partial=False)``),
and ``--save-final-full-model 1`` writes the result back there with ``smp.save_checkpoint(..., partial=False)``.
Synthetic tokens (no dataset download).

Each rank writes ``$SMP2DS_SCRIPT_OUT/rank<N>.json``: losses, the final weights (HF names) and how
far the checkpoint's Hugging Face logits are from the distributed model's. With ``--checkpoint-dir``
rank 0 also saves the model's starting weights there in Hugging Face's names (``initial_hf.pt``), so
a reference can start where the distributed model did.
"""

import argparse
import functools
import json
import os

import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoConfig,
    GPTNeoForCausalLM,
    set_seed,
)

import smdistributed.modelparallel.torch as smp
from smdistributed.modelparallel.torch.nn.huggingface.gpt2 import (
    translate_hf_state_dict_to_smdistributed_gpt2,
    translate_state_dict_to_hf_gpt2,
)
from smdistributed.modelparallel.torch.nn.huggingface.gptneo import (
    translate_hf_state_dict_to_smdistributed_gptneo,
    translate_state_dict_to_hf_gptneo,
)

VOCAB, SEQ = 48, 8


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-type", choices=["gpt2", "gpt_neo"], default="gpt2")
    parser.add_argument("--tensor-parallel-degree", type=int, default=1)
    parser.add_argument("--pipeline-parallel-degree", type=int, default=1)
    parser.add_argument("--sharded-data-parallel-degree", type=int, default=1)
    parser.add_argument("--prescaled-batch", type=int, default=0)
    parser.add_argument("--delayed-param", type=int, default=0)
    parser.add_argument("--use-distributed-transformer", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--train-batch-size", type=int, default=3, help="per data-parallel rank")
    parser.add_argument("--activation-checkpointing", type=int, default=1)
    parser.add_argument("--checkpoint-sublayers", type=int, default=1)
    parser.add_argument("--manual-partition", type=int, default=1)
    parser.add_argument("--attention-in-fp32", type=int, default=0)
    parser.add_argument("--residual-addition-in-fp32", type=int, default=0)
    parser.add_argument("--query-key-layer-scaling", type=int, default=0)
    parser.add_argument("--fused-softmax", type=int, default=1)
    parser.add_argument("--fused-bias-gelu", type=int, default=0)
    parser.add_argument("--flash-attention", type=int, default=1)  # SMP's example default
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--adam-eps", type=float, default=1e-8)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--init-from", default=None, help="a Hugging Face GPT-2 state dict (torch.save) to start from")
    parser.add_argument("--checkpoint-dir", default=None)
    # SMP's fine-tuning path: start from a Hugging Face model, save the result in Hugging Face's names
    parser.add_argument("--fine-tune", type=int, default=0)
    parser.add_argument("--model-name", default=None, help="the pretrained model (from_pretrained) to fine-tune")
    parser.add_argument("--model-dir", default=None, help="where fullmodel.pt goes")
    parser.add_argument("--save-final-full-model", type=int, default=0)
    return parser.parse_args()


def model_config(model_type="gpt2"):
    if model_type == "gpt_neo":  # one global and one local (window 3) attention layer
        return GPTNeoConfig(num_layers=2, num_heads=4, hidden_size=16, vocab_size=VOCAB, max_position_embeddings=SEQ,
                            attention_types=[[["global", "local"], 1]], window_size=3, resid_dropout=0.0,
                            embed_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0, use_cache=False)
    return GPT2Config(n_layer=2, n_head=4, n_embd=16, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False)


MODELS = {"gpt2": (GPT2LMHeadModel, translate_hf_state_dict_to_smdistributed_gpt2,
                   functools.partial(translate_state_dict_to_hf_gpt2, max_seq_len=SEQ)),
          "gpt_neo": (GPTNeoForCausalLM, translate_hf_state_dict_to_smdistributed_gptneo,
                      translate_state_dict_to_hf_gptneo)}


def batches(steps, global_batch, seed=77):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (steps, global_batch, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[:, ::2, SEQ - 2:] = 0  # some right padding
    return ids, mask


@smp.step
def train_step(model, input_ids, attention_mask):
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)["loss"]
    model.backward(loss)
    return loss


@smp.step
def logits_step(model, input_ids):
    return model(input_ids=input_ids).logits


def main():
    args = parse_args()
    smp_config = {"ddp": True, "tensor_parallel_degree": args.tensor_parallel_degree,
                  "pipeline_parallel_degree": args.pipeline_parallel_degree, "microbatches": 1,
                  "prescaled_batch": args.prescaled_batch > 0}
    if args.sharded_data_parallel_degree > 1:
        smp_config["sharded_data_parallel_degree"] = args.sharded_data_parallel_degree
        smp_config["delayed_parameter_initialization"] = args.delayed_param > 0
    smp.init(smp_config)
    # the following improves start-up time by skipping proper initialization of weights in the original
    # model (SMP's example); this is not a problem because DistributedModel will override those weights
    # anyway when we use distributed transformer.
    if args.use_distributed_transformer > 0:
        from transformers.modeling_utils import PreTrainedModel

        PreTrainedModel.init_weights = lambda x: None
    if args.fine_tune > 0 and smp.rank() == 0:
        pretrained_model = AutoModelForCausalLM.from_pretrained(args.model_name)
        model_state_dict = pretrained_model.state_dict()
        path = os.path.join(args.model_dir, "fullmodel.pt")
        torch.save(model_state_dict, path)
    smp.barrier()
    set_seed(args.seed)
    model_cls, hf_to_smp, smp_to_hf = MODELS[args.model_type]
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1 or args.use_distributed_transformer > 0,
                            dtype=torch.float32, distribute_embedding=False, use_alibi=False,
                            attention_in_fp32=args.attention_in_fp32 > 0,
                            fp32_residual_addition=args.residual_addition_in_fp32 > 0,
                            query_key_layer_scaling=args.query_key_layer_scaling > 0,
                            fused_softmax=args.fused_softmax > 0, fused_bias_gelu=args.fused_bias_gelu > 0,
                            flash_attention=args.flash_attention > 0):
        model = AutoModelForCausalLM.from_config(model_config(args.model_type))
    model = smp.DistributedModel(model, trace_device="gpu")
    if args.init_from:
        model.load_state_dict(hf_to_smp(torch.load(args.init_from)))
    if args.checkpoint_dir:
        initial = smp_to_hf(model.state_dict())  # collective under tp
        if smp.rank() == 0:
            torch.save(initial, os.path.join(args.checkpoint_dir, "initial_hf.pt"))
        del initial

    transformer_layers = model.get_module().transformer.seq_layers
    if args.manual_partition:
        per_partition = max(1, len(transformer_layers) // smp.pp_size())
        for i, c in enumerate(transformer_layers.children()):
            smp.set_partition(c, min(i // per_partition, smp.pp_size() - 1))
    if args.activation_checkpointing:
        if args.checkpoint_sublayers:
            for c in transformer_layers.children():
                smp.set_activation_checkpointing(c.attention)
                smp.set_activation_checkpointing(c.output)
        else:
            smp.set_activation_checkpointing(transformer_layers, strategy="each")

    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                                              eps=args.adam_eps))
    if args.fine_tune > 0:
        smp.resume_from_checkpoint(args.model_dir, tag="fullmodel.pt", partial=False)
    b = args.train_batch_size
    # prescaled_batch: the tensor-parallel group shares one batch, sharded by rdp_rank
    data_rank, data_size = (smp.rdp_rank(), smp.rdp_size()) if args.prescaled_batch else (smp.dp_rank(), smp.dp_size())
    ids, mask = batches(args.steps, b * data_size)
    rows = slice(data_rank * b, (data_rank + 1) * b)
    losses = []
    model.train()
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        losses.append(train_step(model, ids[step, rows], mask[step, rows]).reduce_mean().item())
        optimizer.step()

    if args.save_final_full_model > 0:
        # saves the model in Hugging Face's names (SMP's translate functions)
        smp.save_checkpoint(args.model_dir, tag="fullmodel.pt", partial=False, model=model)
    hf_dict = smp_to_hf(model.state_dict())  # collective under tp
    report = {"rank": smp.rank(), "dp_rank": data_rank, "tp": [smp.tp_rank(), smp.tp_size()],
              "pp": [smp.pp_rank(), smp.pp_size()],
              "class": type(model.get_module()).__name__, "losses": losses,
              "weights": {k: v.float().flatten().tolist() for k, v in hf_dict.items()}}
    if args.checkpoint_dir:
        path = os.path.join(args.checkpoint_dir, f"{args.model_type}_hf.pt")
        if smp.rank() == 0:
            smp.save(hf_dict, path, partial=False)
        smp.barrier()
        hf = model_cls(model_config(args.model_type))
        hf.load_state_dict(smp.load(path, partial=False), strict=True)
        hf.eval()
        model.eval()
        with torch.no_grad():
            want = logits_step(model, ids[0, rows]).concat()
            got = hf(input_ids=ids[0, rows]).logits
        report["checkpoint_logits_max_diff"] = float((got - want).abs().max())
    with open(os.path.join(os.environ["SMP2DS_SCRIPT_OUT"], f"rank{smp.rank()}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
