"""Tensor parallelism without processes: shard arithmetic, Hugging Face rules against the installed
transformers, the marking/registration registry, and ``smp.nn.huggingface`` translators."""

from __future__ import annotations

import importlib

import pytest
import torch

from smp2ds.engine.nn.parallel import marks
from smp2ds.engine.nn.parallel.group import TPGroup
from smp2ds.engine.nn.parallel.layers import make_column_parallel, make_row_parallel
from smp2ds.engine.nn.parallel.shards import ShardSpec, spec_of
from smp2ds.engine.tensor_parallel import families, registry
from tests.engine.hf_equivalence import assert_same_state
from tests.engine.workers import tp_workers as tw


@pytest.mark.parametrize(("tp", "blocks"), [(2, 1), (2, 3), (4, 3), (4, 1)])
def test_shards_join_back_to_the_full_tensor(tp, blocks):
    full = torch.arange(2 * 24, dtype=torch.float32).reshape(2, 24)
    spec = ShardSpec(dim=1, size=tp, blocks=blocks)
    pieces = [spec.local(full, r) for r in range(tp)]
    assert all(p.shape == (2, 24 // tp) for p in pieces)
    assert torch.equal(spec.join(pieces), full)


def test_fused_qkv_keeps_each_heads_query_key_and_value_on_one_rank():
    # GPT-2 c_attn (Conv1D, weight [in, 3*H]): H = 4 heads x 2; rank r must get heads 2r, 2r+1 of q, k and v
    hidden, heads, hd = 8, 4, 2
    conv = importlib.import_module("transformers.pytorch_utils").Conv1D(3 * hidden, hidden)
    with torch.no_grad():
        conv.weight.copy_(torch.arange(3 * hidden).repeat(hidden, 1))  # column index = output feature
    make_column_parallel(conv, TPGroup(handle=None, rank=1, size=2, ranks=(0, 1)), blocks=3)
    cols = conv.weight[0].tolist()
    per_head = heads // 2 * hd
    want = [block * hidden + per_head + i for block in range(3) for i in range(per_head)]
    assert cols == want
    assert conv.weight.shape == (hidden, 3 * hidden // 2) and conv.bias.shape == (3 * hidden // 2,)
    assert spec_of(conv.weight).full_shape == (hidden, 3 * hidden)


def test_row_parallel_linear_splits_inputs_and_keeps_the_bias_whole():
    lin = torch.nn.Linear(8, 6)
    make_row_parallel(lin, TPGroup(handle=None, rank=0, size=2, ranks=(0, 1)))
    assert lin.weight.shape == (6, 4) and lin.bias.shape == (6,) and spec_of(lin.bias) is None
    assert isinstance(lin, torch.nn.Linear) and "weight" in dict(lin.named_parameters())


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert", "gpt_neox"])
def test_every_rule_names_modules_the_installed_transformers_has(family):
    model = tw.hf_model(family, 0)
    found = list(families.blocks(model))
    assert len(found) == 2
    for name, block, rule in found:
        for path in (*rule.column, *rule.row):
            assert isinstance(block.get_submodule(path), torch.nn.Module), f"{name}.{path}"
        assert any(hasattr(block.get_submodule(d.rpartition(".")[0]), d.rpartition(".")[2]) for d in rule.heads) \
            or rule.family in ("llama", "gpt_neox"), f"{name}: none of {rule.heads} exists"  # these reshape with -1


def test_uneven_head_counts_are_refused_with_the_numbers():
    model = tw.hf_model("llama", 0)  # 4 heads, 2 key/value heads
    with pytest.raises(Exception, match=r"tensor_parallel_degree 4 must divide the attention head counts "
                                        r"\(.*num_key_value_heads=2"):
        families.check_divisible(model.config, 4, "LlamaForCausalLM")


def test_tensor_parallelism_marks_modules_created_inside_and_nesting_overrides():
    init = torch.nn.Module.__init__
    with marks.tensor_parallelism(fused_softmax=False):
        outer = torch.nn.Linear(2, 2)
        with marks.tensor_parallelism(enabled=False):
            inner = torch.nn.Linear(2, 2)
    after = torch.nn.Linear(2, 2)
    assert marks.mark_of(outer) == marks.Mark(True, {"fused_softmax": False})
    assert marks.mark_of(inner).enabled is False and marks.mark_of(after) is None
    assert torch.nn.Module.__init__ is init  # patched only inside the context
    tree = torch.nn.Sequential(torch.nn.Linear(2, 2))
    marks.set_tensor_parallelism(tree)
    assert all(marks.mark_of(m).enabled for m in tree.modules())


def test_tp_register_records_constructor_arguments_for_init_hook():
    class Block(torch.nn.Module):
        def __init__(self, width: int, scale: float = 1.0):
            super().__init__()
            self.lin = torch.nn.Linear(width, width)

    class DistBlock(torch.nn.Module):
        pass

    registry.register(Block, DistBlock, init_hook=lambda width, scale=1.0: ((width * 2,), {}))
    block = Block(3, scale=0.5)
    assert getattr(block, registry.INIT_ARGS) == ((3,), {"scale": 0.5})
    assert registry.registration_for(Block).dist_module is DistBlock
    with pytest.raises(TypeError, match="module_cls must be an nn.Module class, got 3"):
        registry.register(3, DistBlock)  # type: ignore[arg-type]


@pytest.mark.parametrize(("module", "family", "extra"), [
    ("gpt2", "gpt2", {}), ("bert", "bert", {}), ("roberta", "roberta", {}),
    ("gptneox", "gpt_neox", {"num_attention_heads": 4}), ("gptj", "gptj", {}), ("gptneo", "gpt_neo", {}),
])
def test_huggingface_translators_round_trip_exactly(module, family, extra):
    mod = importlib.import_module(f"smdistributed.modelparallel.torch.nn.huggingface.{module}")
    to_smp = getattr(mod, f"translate_hf_state_dict_to_smdistributed_{module}")
    to_hf = getattr(mod, f"translate_state_dict_to_hf_{module}")
    model = tw.hf_model(family, 0)
    hf = model.state_dict()
    marked = {**to_smp(hf, **extra), "_smp_is_partial": False, "_smp_load_info": {}}
    back = to_hf(marked, **extra)
    assert_same_state(back, hf)
    model.load_state_dict(back, strict=True)
    with pytest.raises(TypeError, match="a state dict"):
        to_hf([1, 2])
