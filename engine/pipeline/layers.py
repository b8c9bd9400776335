"""Layer lists: a model as the sequence of layers DeepSpeed's `PipelineModule` runs.

A `LayerList` holds, per layer, the entry handed to `PipelineModule` (an ``nn.Module`` or a
`TiedLayerSpec`), the original modules whose parameters it holds (for the partition cost) and
the modules whose ``smp.partition`` assignment decides its stage, plus a `ModelAdapter` that
turns the user's ``model(...)`` call into the first stage's input tensors and the last stage's
output into what the call returns.

Layers take one argument (a tensor or a tuple of tensors) and return one, because DeepSpeed's
pipeline sends only tensors between stages. Floating-point tensors crossing a stage boundary
must carry gradients; masks cross as integer tensors.

Named families (`build_layer_list`): ``nn.Sequential``; Hugging Face ``GPT2LMHeadModel``,
``BertForSequenceClassification``, ``BertForQuestionAnswering``, ``BertForMaskedLM``, RoBERTa's three
equivalents, ``OPTForCausalLM``, ``BloomForCausalLM``; the encoder-decoder ``T5ForConditionalGeneration`` (T5, Flan-T5:
encoder stages then decoder stages, ``families/t5``); any other
``*ForCausalLM`` (LLaMA, Mistral, Qwen, ...) cut by its decoder structure (``families/hf_decoder``). Any other module
goes through the traced family (``families/traced``: ``torch.fx`` symbolic tracing, cut between
``torch.nn`` leaf modules), which refuses a model only when tracing or cutting fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from deepspeed.pipe import TiedLayerSpec
from torch import nn

from smp2ds.engine.exceptions import SMPUnsupportedError

SUPPORTED = ("torch.nn.Sequential", "transformers GPT2LMHeadModel", "transformers BertForSequenceClassification",
             "transformers BertForQuestionAnswering", "transformers BertForMaskedLM",
             "transformers RobertaForSequenceClassification", "transformers RobertaForQuestionAnswering",
             "transformers RobertaForMaskedLM", "transformers LlamaForCausalLM", "transformers OPTForCausalLM",
             "transformers BloomForCausalLM", "transformers T5ForConditionalGeneration",
             "smp.nn.DistributedTransformerLMHead",
             "other transformers *ForCausalLM decoders (embedding, ModuleList of blocks, final norm, head)")


class UnsupportedModelError(SMPUnsupportedError, TypeError):
    """The model has no layer list; the message names the supported families and the way out."""


class ModelAdapter(Protocol):
    """Converts between the user's ``model(...)`` call and the pipeline's tensors."""

    def pipe_inputs(self, args: tuple, kwargs: dict) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """First stage: the input of layer 0 for one micro-batch's call."""

    def make_output(self, output: Any, args: tuple, kwargs: dict) -> Any:
        """Last stage: what ``model(*args, **kwargs)`` returns, given the last layer's output."""


class SharedModule(nn.Module):
    """Holds a module that lives in the user's model, so a `TiedLayerSpec` can "build" it.

    DeepSpeed builds tied modules from a class and arguments; building this class with the
    original module reuses the model's own (already initialised) weight instead of a new one.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


@dataclass(frozen=True, eq=False)
class PipeLayer:
    """One entry of the layer list."""

    name: str
    """Display name, normally the original module path (``transformer.h.3``)."""
    entry: Any
    """What `PipelineModule` receives: an ``nn.Module`` or a `TiedLayerSpec`."""
    modules: tuple[nn.Module, ...]
    """Original modules whose parameters and buffers this layer holds."""
    owners: tuple[nn.Module, ...]
    """Original modules whose manual partition decides this layer's stage."""
    compute: float | None = None
    """Forward-FLOP proxy override (tied heads use an embedding matrix as a dense layer)."""

    @property
    def memory(self) -> int:
        """Parameter bytes this layer holds (a tied weight counts on every stage holding it)."""
        seen: dict[int, torch.Tensor] = {}
        for module in self.modules:
            for p in module.parameters():
                seen[id(p)] = p
        return sum(p.numel() * p.element_size() for p in seen.values())

    @property
    def flops(self) -> float:
        """Forward FLOPs per position from the dense weights (see `compute_proxy`)."""
        if self.compute is not None:
            return float(self.compute)
        return float(sum(compute_proxy(m) for m in self.modules))


@dataclass(frozen=True, eq=False)
class LayerList:
    """A model as pipeline layers, with the adapter for its calls."""

    family: str
    layers: tuple[PipeLayer, ...]
    adapter: ModelAdapter
    model: nn.Module
    buffer_slots: tuple[tuple[nn.Module, str, str], ...] = ()
    """``(holder, attribute, state_dict key)`` for buffers a layer holds outside their own module."""

    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    @property
    def entries(self) -> list[Any]:
        return [layer.entry for layer in self.layers]


def compute_proxy(module: nn.Module) -> float:
    """Forward FLOPs per input position from dense weights, the partitioner's compute measure.

    A dense weight of ``n`` elements costs ``2n`` FLOPs per position (multiply and add):
    ``nn.Linear``, Hugging Face ``Conv1D`` and ``nn.Conv*`` weights count that way. Embedding
    lookups cost nothing. Every other parameter (norm scales, biases) counts its element count.
    Attention's score matrix (proportional to sequence length) is not counted: it is not known
    when the model is partitioned and is the same in every transformer block, so it does not move
    the balance between blocks.
    """
    total = 0.0
    for sub in module.modules():
        if isinstance(sub, nn.Embedding):
            continue
        dense = isinstance(sub, (nn.Linear, nn.modules.conv._ConvNd)) or type(sub).__name__ == "Conv1D"
        for name, p in sub.named_parameters(recurse=False):
            total += 2.0 * p.numel() if dense and name == "weight" else float(p.numel())
    return total


def tied(key: str, module: nn.Module, forward_fn: Callable[[nn.Module, Any], Any],
         attr: str = "weight") -> TiedLayerSpec:
    """A `TiedLayerSpec` that reuses ``module`` (wrapped in `SharedModule`) on every stage using it."""
    return TiedLayerSpec(key, SharedModule, module, forward_fn=forward_fn, tied_weight_attr=[f"module.{attr}"])


def module_path(model: nn.Module, target: nn.Module) -> str:
    """Dotted path of ``target`` inside ``model`` (``""`` for the model itself)."""
    for name, sub in model.named_modules(remove_duplicate=False):
        if sub is target:
            return name
    return type(target).__name__


Matcher = Callable[[nn.Module], bool]
Builder = Callable[[nn.Module], LayerList]
_FAMILIES: list[tuple[str, Matcher, Builder]] = []
"""(name, matches, build) in registration order; filled by ``smp2ds.engine.pipeline.families``."""


def register_family(name: str, matches: Matcher, build: Builder) -> None:
    """Teach `build_layer_list` a model family (the families package registers the built-in ones)."""
    if any(existing == name for existing, _, _ in _FAMILIES):
        return
    _FAMILIES.append((name, matches, build))


def build_layer_list(model: nn.Module) -> LayerList:
    """The layer list for a supported model; `UnsupportedModelError` for anything else."""
    builders = [(matches, build) for _, matches, build in _FAMILIES]
    for matches, build in builders:
        if matches(model):
            return build(model)
    raise UnsupportedModelError(
        f"pipeline parallelism cannot split a {type(model).__module__}.{type(model).__name__}: smp2ds builds "
        f"pipeline layer lists for {', '.join(SUPPORTED)}. To pipeline another model, express it as a "
        "torch.nn.Sequential whose children each take and return one tensor (or a tuple of tensors), with the "
        "loss computed from its output inside the @smp.step function; stage placement then follows "
        "memory_weight, or smp.partition(i) / smp.set_partition(child, i) with auto_partition: false.")
