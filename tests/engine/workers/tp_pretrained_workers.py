"""Rank bodies for fine-tuning pretrained Hugging Face models under tensor parallelism, the way SMP scripts
do at tp > 1: rank 0 writes a tiny model with ``save_pretrained``; every rank loads it with
``AutoModelForCausalLM.from_pretrained(dir)`` inside ``smp.model_creation(tensor_parallelism=True)`` and
wraps it. The test compares, per family, the gathered ``state_dict()`` after wrapping with the pretrained
weights, the logits with Hugging Face's, and a few SGD steps with single-process Hugging Face fine-tuning
from the same weights (:func:`reference`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.engine.hf_equivalence import fine_tune

VOCAB, SEQ, ROWS = 64, 8, 4
IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
COMMON = {"vocab_size": VOCAB, "max_position_embeddings": 32, "tie_word_embeddings": False, **IDS}

FAMILIES = ("llama", "mistral", "qwen2", "starcoder2", "olmo2", "stablelm", "phi3", "granite", "falcon")


CONFIGS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
           "starcoder2": "Starcoder2Config", "olmo2": "Olmo2Config", "stablelm": "StableLmConfig",
           "phi3": "Phi3Config", "granite": "GraniteConfig"}
"""Family -> its transformers config class (Falcon's sizes are spelled differently, see :func:`config`)."""


def config(family: str) -> Any:
    """A tiny config of ``family`` (4 query heads, 2 key/value heads)."""
    import transformers as tf

    if family == "falcon":
        cfg = tf.FalconConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=4, new_decoder_architecture=True,
                              num_kv_heads=2, alibi=False, bias=True, **COMMON)
    else:
        cfg = getattr(tf, CONFIGS[family])(num_hidden_layers=2, hidden_size=16, num_attention_heads=4,
                                           num_key_value_heads=2, intermediate_size=32, **COMMON)
    cfg._attn_implementation = "eager"
    return cfg


def pretrained_dir(family: str, root: str) -> str:
    """Where rank 0 saved ``family``'s pretrained model (seeded: the test rebuilds the same one)."""
    return os.path.join(root, f"pretrained-{family}")


def save_pretrained(family: str, root: str) -> str:
    """Build ``family`` with Hugging Face's own init from a fixed seed and save it, as a hub model would be."""
    import transformers as tf

    torch.manual_seed(100 + FAMILIES.index(family))
    model = tf.AutoModelForCausalLM.from_config(config(family))
    path = pretrained_dir(family, root)
    model.save_pretrained(path)
    return path


def load_pretrained(path: str) -> torch.nn.Module:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    model.config.use_cache = False
    return model


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(700 + step))


def reference(path: str, steps: int, lr: float) -> dict:
    """Single-process Hugging Face fine-tuning from the pretrained weights: the logits of the first batch,
    the loss of each step and the final weights."""
    model = load_pretrained(path)
    return {"pretrained": load_pretrained(path).state_dict(),
            **fine_tune(model, torch.optim.SGD(model.parameters(), lr=lr), batch, steps)}


def run_fine_tune(config_: dict, families: list[str], steps: int, lr: float) -> list[dict]:
    """Per family: the wrapped model's gathered state right after wrapping, its logits on the first batch,
    its losses over ``steps`` SGD steps (every rank trains on the same batch) and its final weights."""
    import smdistributed.modelparallel.torch as smp
    from tests.engine.workers.train_workers import plain

    smp.init(config_)
    root = os.environ["SMP2DS_TEST_TMPDIR"]
    if smp.rank() == 0:
        for family in families:
            save_pretrained(family, root)
    smp.barrier()
    results = []
    for family in families:
        smp.reset()
        with smp.model_creation(tensor_parallelism=True):
            net = load_pretrained(pretrained_dir(family, root))
        model = smp.DistributedModel(net)
        out: dict[str, Any] = {"family": family, "wrapped": _copy(model.state_dict())}
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr))

        @smp.step
        def logits_of(model: Any, ids: torch.Tensor) -> torch.Tensor:
            return model(input_ids=ids).logits

        @smp.step
        def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
            loss = model(input_ids=ids, labels=ids).loss
            model.backward(loss)
            return loss

        model.eval()
        with torch.no_grad():
            out["logits"] = logits_of(model, batch(0)).concat()
        model.train()
        out["losses"] = []
        for step in range(steps):
            out["losses"].append(train_step(model, batch(step)).reduce_mean().item())
            opt.step()
            opt.zero_grad()
        out["weights"] = _copy(model.state_dict())
        results.append(out)
    smp.barrier()
    return plain(results)


def _copy(sd: dict) -> dict:
    return {k: v.detach().clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}


class _RenamedLinear(torch.nn.Module):
    """A distributed class whose parameter is not named like ``nn.Linear``'s: weights cannot be carried."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.kernel = torch.nn.Parameter(torch.zeros(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.kernel.t()


class _Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 8)


def run_what_cannot_be_kept() -> dict:
    """tp 2: (1) a Hugging Face model with the init skipped, as SMP's scripts do, keeps the replaced layers'
    own fresh init and reports them; (2) a registered class that cannot hold a loaded layer's weights is
    refused at ``smp.DistributedModel``, naming the layer; (3) for a module outside Hugging Face it warns."""
    import warnings

    import transformers as tf
    from transformers.modeling_utils import PreTrainedModel

    import smdistributed.modelparallel.torch as smp
    from tests.engine.workers.train_workers import plain

    smp.init({"ddp": True, "tensor_parallel_degree": 2})
    root = os.environ["SMP2DS_TEST_TMPDIR"]
    out: dict[str, Any] = {}
    original = PreTrainedModel.init_weights
    PreTrainedModel.init_weights = lambda self: None
    try:
        torch.manual_seed(3)
        with smp.model_creation(tensor_parallelism=True):
            net = tf.AutoModelForCausalLM.from_config(config("qwen2"))
        held = _copy(net.state_dict())
        model = smp.DistributedModel(net)
        out["skipped"] = {"held": held, "wrapped": _copy(model.state_dict()), "fresh": net._smp2ds_tp_report.fresh}
    finally:
        PreTrainedModel.init_weights = original
    if smp.rank() == 0:
        save_pretrained("qwen2", root)
    smp.barrier()
    smp.reset()
    smp.tp_register_with_module(torch.nn.Linear, _RenamedLinear)
    with smp.model_creation(tensor_parallelism=True):
        net = load_pretrained(pretrained_dir("qwen2", root))
    try:
        smp.DistributedModel(net)
        out["refused"] = None
    except smp.exceptions.SMPUnsupportedError as err:
        out["refused"] = str(err)
    smp.reset()
    with smp.tensor_parallelism():
        head = _Head()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        smp.DistributedModel(head)
    out["warned"] = [str(w.message) for w in caught if "its replacement" in str(w.message)]
    smp.tp_register_with_module(torch.nn.Linear, smp.nn.DistributedLinear)
    smp.barrier()
    return plain(out)
