"""Rank bodies and rows for the measured-versus-estimated memory checks (tests and ``bench/memory_estimate_accuracy``).

`measured_peak` runs two real training steps of the engine on one rank, as a user's script runs them (the garbage
collector neither run before a step nor held off during it), under one of two counters started before the model is
built, so DeepSpeed's copies, buckets and optimizer state are counted as they are allocated:
``smp2ds.engine.memory.measure.LiveTensorBytes`` (bytes of live tensor storages) or, with ``counter="allocator"``,
``AllocatorPeak`` (PyTorch's CPU allocator's running total from the profiler). `estimated_roles` is what
``smp2ds explain --memory`` computes for the same row.

With pipelines the script builds the whole model on every rank and DeepSpeed's pipeline module moves only the
stage's layers to the device; the other stages' parameters (host memory on a GPU machine) are subtracted from the
measurement.
"""

from __future__ import annotations

import json
import resource
from typing import Any

SEQ, BATCH = 128, 4
CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 4, "n_embd": 256, "n_head": 4,
             "vocab_size": 4096, "n_positions": 256, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "hidden_size": 256,
              "intermediate_size": 768, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096,
              "max_position_embeddings": 256},
    "bert": {"model_type": "bert", "architectures": ["BertForMaskedLM"], "num_hidden_layers": 4, "hidden_size": 256,
             "intermediate_size": 1024, "num_attention_heads": 4, "vocab_size": 4096, "max_position_embeddings": 256,
             "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
    # no in-place sharding rule: tensor parallelism replaces its nn.Linear / nn.Embedding layers by smp.nn modules
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4, "hidden_size": 256,
              "intermediate_size": 768, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096,
              "max_position_embeddings": 256, "tie_word_embeddings": False},
}
FAMILIES = ("gpt2", "llama", "bert")
"""The families of the full table (``qwen2`` is measured at tp 2 only)."""
LAYOUTS: dict[str, dict[str, Any]] = {
    "ddp": {"ddp": True, "microbatches": 2},
    "zero1": {"ddp": True, "microbatches": 2, "shard_optimizer_state": True},
    "pp2": {"ddp": True, "pipeline_parallel_degree": 2, "microbatches": 4, "partitions": 2},
    "tp2": {"ddp": True, "tensor_parallel_degree": 2, "microbatches": 2},
    "sdp2": {"ddp": True, "sharded_data_parallel_degree": 2, "microbatches": 2},
    # every parameter over 1000 elements partitioned and gathered, 2e5-element reduce buckets, 4e5 live elements
    "sdp2small": {"ddp": True, "sharded_data_parallel_degree": 2, "microbatches": 2,
                  "sdp_param_persistence_threshold": 1000, "sdp_reduce_bucket_size": 200000,
                  "sdp_max_live_parameters": 400000},
}


def write_config(family: str, path: str) -> str:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(CONFIGS[family], fh)
    return path


def _blocks(model: Any) -> list:
    lists = [m for m in model.modules() if type(m).__name__ == "ModuleList" and len(m)]
    return list(max(lists, key=lambda blocks: sum(p.numel() for p in blocks.parameters())))


def _params(layout: str | dict[str, Any]) -> dict[str, Any]:
    return dict(LAYOUTS[layout]) if isinstance(layout, str) else dict(layout)


def measured_peak(family: str, layout: str | dict[str, Any], ckpt: bool, config_path: str,
                  batch: int = BATCH, seq: int = SEQ, counter: str = "live") -> dict[str, Any]:
    """This rank's measured peak for the row (run on every rank of a 2-rank world); ``layout`` names a row of
    `LAYOUTS` or is the SMP parameters themselves; ``counter`` is ``live`` (`LiveTensorBytes`) or ``allocator``
    (`AllocatorPeak`: its ``peak`` as measured, and ``recorded`` / ``unseen_frees`` in the result; with ``live`` the
    result's ``freed_elsewhere`` is the bytes freed on other threads, by thread)."""
    import torch
    import transformers

    import smdistributed.modelparallel.torch as smp
    from smp2ds.engine.memory.measure import AllocatorPeak, LiveTensorBytes

    params = _params(layout)
    smp.init(params)
    with open(config_path, encoding="utf-8") as fh:
        config = json.load(fh)
    cls = getattr(transformers, config["architectures"][0])
    hf = transformers.AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items()
                                                                     if k != "model_type"})
    torch.manual_seed(0)
    count: Any = AllocatorPeak() if counter == "allocator" else LiveTensorBytes()
    with count:
        with smp.model_creation(tensor_parallelism=params.get("tensor_parallel_degree", 1) > 1):
            built = cls(hf)
        model = smp.DistributedModel(built)
        held = {id(p) for p in model.local_parameters()}
        off_stage = sum(p.numel() * p.element_size() for p in built.parameters() if id(p) not in held)
        del built
        if ckpt:
            for block in _blocks(model):
                smp.set_activation_checkpointing(block)
        optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))
        ids = torch.randint(0, config["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(smp.rank()))

        @smp.step
        def train_step(model: Any, ids: Any) -> Any:
            out = model(input_ids=ids, labels=ids)
            model.backward(out.loss)
            return out.loss

        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            train_step(model, ids)
            optimizer.step()
    extra = ({"recorded": count.peak - off_stage, "unseen_frees": count.unseen_frees} if counter == "allocator"
             else {"freed_elsewhere": count.freed_elsewhere})
    peak = count.peak_corrected if counter == "allocator" else count.peak
    return {"rank": smp.rank(), "pp_rank": smp.pp_rank(), "tp_rank": smp.tp_rank(),
            "measured": peak - off_stage, "off_stage": off_stage, **extra,
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def estimated_roles(layout: str | dict[str, Any], ckpt: bool, config_path: str, world: int = 2, batch: int = BATCH,
                    seq: int = SEQ) -> list[dict[str, Any]]:
    """``smp2ds explain --memory``'s roles for the row, as dicts."""
    from smp2ds.engine.memory import estimate_memory, load_model_source
    from smp2ds.engine.memory.step_shape import step_shape
    from smp2ds.translator.normalize import normalize
    from smp2ds.translator.plan_types import Layout
    from smp2ds.translator.planner import plan

    lay = Layout(world_size=world)
    result = plan(normalize(_params(layout), lay), lay)
    shape = step_shape(result, batch_per_rank=batch, seq_len=seq, activation_checkpointing=ckpt, backend="gloo")
    return [r.to_dict() for r in estimate_memory(load_model_source(config_path), shape).roles]
