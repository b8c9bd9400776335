"""GPT-2, GPT-NeoX, GPT-J and GPT-Neo replaced by ``smp.nn.DistributedTransformerLMHead`` (tp 1, no
processes) when the script skipped Hugging Face's weight init as SMP's examples do
(``PreTrainedModel.init_weights = lambda x: None``), when it did not, and when it loaded weights with
``from_pretrained``:

* init skipped: the replaced model starts from the distributed transformer's own initialisation
  (every parameter finite; weight matrices and embeddings with std near the config's
  ``initializer_range``, biases zero, layer norms one) and its first loss is near ln(vocab), where
  the Hugging Face tensors it was built from are not;
* weights initialised or loaded: kept (logits equal Hugging Face's);
* the head is tied to the embedding exactly when ``config.tie_word_embeddings`` says so, both ways,
  in all three cases (with untied heads keeping Hugging Face's head weights when they were real).
"""

from __future__ import annotations

import math

import pytest
import torch

from smp2ds.engine.nn.huggingface.fresh import initialised
from smp2ds.engine.nn.parallel import marks
from smp2ds.engine.nn.parallel.context import ParallelContext
from smp2ds.engine.tensor_parallel.transformer_replacement import replace_marked

VOCAB, RANGE = 64, 0.03
FAMILIES = ("gpt2", "gpt_neox", "gptj", "gpt_neo")
TIES = [(f, t) for f in FAMILIES for t in (True, False)]


def config(family: str, tie: bool):
    import transformers as tf

    common = {"vocab_size": VOCAB, "initializer_range": RANGE, "tie_word_embeddings": tie}
    if family == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, **common)
    elif family == "gptj":
        cfg = tf.GPTJConfig(n_layer=2, n_embd=32, n_head=4, n_positions=16, rotary_dim=4, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, **common)
    elif family == "gpt_neox":
        cfg = tf.GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                               max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0, **common)
    else:
        cfg = tf.GPTNeoConfig(num_layers=2, hidden_size=32, num_heads=4, max_position_embeddings=16,
                              attention_types=[[["global", "local"], 1]], window_size=4, resid_dropout=0.0,
                              embed_dropout=0.0, attention_dropout=0.0, **common)
    cfg._attn_implementation = "eager"
    return cfg


@pytest.fixture
def skip_hf_init(monkeypatch):
    """SMP's example scripts' patch, undone after the test."""
    from transformers.modeling_utils import PreTrainedModel

    original = PreTrainedModel.init_weights
    monkeypatch.setattr(PreTrainedModel, "init_weights", lambda x: None)
    yield
    monkeypatch.undo()
    assert PreTrainedModel.init_weights is original


def build(cfg, pretrained: str | None = None) -> torch.nn.Module:
    """A Hugging Face model built the way SMP's example builds it, marked for SMP's transformer."""
    import transformers as tf

    torch.manual_seed(5)
    with marks.tensor_parallelism(fused_softmax=True):
        if pretrained:
            return tf.AutoModelForCausalLM.from_pretrained(pretrained)
        return tf.AutoModelForCausalLM.from_config(cfg)


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(1))


def assert_head_follows_config(new: torch.nn.Module, tie: bool) -> None:
    assert (new.lm_head is None) == tie
    if not tie:
        assert not torch.equal(new.lm_head.weight, new.word_embedding.weight)


def assert_distributed_transformer_init(new: torch.nn.Module) -> None:
    for name, p in new.named_parameters():
        assert torch.isfinite(p).all(), name
        if name.endswith("layernorm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            assert abs(p.std().item() - RANGE) < 0.15 * RANGE, (name, p.std().item())
            assert abs(p.mean().item()) < 0.15 * RANGE, name


@pytest.mark.parametrize("family,tie", TIES)
def test_skipped_hf_init_gets_the_distributed_transformers_own_init(family, tie, skip_hf_init):
    hf = build(config(family, tie))
    assert not any(initialised(hf).values())  # what the script's patch leaves: nothing initialised
    # the tensors Hugging Face left (torch's defaults, N(0, 1) embeddings, or uninitialised memory) are not
    # initializer_range-sized: copying them would fail the checks below
    assert any(not torch.isfinite(p).all() or p.std() > 5 * RANGE for p in hf.parameters() if p.dim() > 1)
    new = replace_marked(hf, ParallelContext())
    assert_distributed_transformer_init(new)
    assert_head_follows_config(new, tie)
    ids = batch()
    loss = new(input_ids=ids, labels=ids).loss.item()
    # fresh weights depend on how many models this process replaced before (the stream advances per model):
    # ~0.05 of spread around ln(vocab) at these sizes; garbage or N(0, 1) weights give losses far above it
    assert abs(loss - math.log(VOCAB)) < 0.1, loss


@pytest.mark.parametrize("family,tie", TIES)
def test_initialised_hf_weights_are_kept_and_the_head_follows_config(family, tie):
    hf = build(config(family, tie))
    assert all(initialised(hf).values())
    ref = build(config(family, tie)).eval()  # same seed: same weights
    head = ref.get_output_embeddings().weight
    assert (head is ref.get_input_embeddings().weight) == tie
    new = replace_marked(hf, ParallelContext()).eval()
    assert_head_follows_config(new, tie)
    if not tie:
        assert torch.equal(new.lm_head.weight, head)
    ids = batch()
    assert torch.allclose(new(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family,tie", [("gpt2", True), ("gpt_neox", False), ("gptj", True), ("gpt_neo", False)])
def test_from_pretrained_with_skipped_init_keeps_the_loaded_weights(family, tie, tmp_path, request):
    saved = build(config(family, tie)).eval()  # built before the patch: real weights
    saved.save_pretrained(tmp_path)
    request.getfixturevalue("skip_hf_init")
    hf = build(None, pretrained=str(tmp_path))
    assert all(initialised(hf).values())
    new = replace_marked(hf, ParallelContext()).eval()
    assert_head_follows_config(new, tie)
    ids = batch()
    assert torch.allclose(new(input_ids=ids).logits, saved(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_each_parameter_is_judged_by_its_own_mark(skip_hf_init):
    hf = build(config("gpt2", True))
    with torch.no_grad():
        hf.transformer.wpe.weight.fill_(0.5)
    hf.transformer.wpe._is_hf_initialized = True  # as PreTrainedModel._initialize_weights marks what it initialised
    hf.transformer.h[0].ln_1.bias._is_hf_initialized = True  # as from_pretrained marks a parameter it loaded
    with torch.no_grad():
        hf.transformer.h[0].ln_1.bias.fill_(0.25)
    new = replace_marked(hf, ParallelContext())
    assert torch.equal(new.position_embedding.weight, torch.full((16, 32), 0.5))
    ln_1 = new.transformer.seq_layers[0].attention.layernorm
    assert torch.equal(ln_1.bias, torch.full((32,), 0.25)) and torch.equal(ln_1.weight, torch.ones(32))
    assert abs(new.word_embedding.weight.std().item() - RANGE) < 0.15 * RANGE  # unmarked: fresh
