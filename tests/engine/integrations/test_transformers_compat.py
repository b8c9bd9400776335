"""`smp2ds.engine.integrations.transformers_compat` on the installed transformers (CI's dependency job
runs this file at the floor 4.41.0, 4.50.3, 4.57.6, 5.17.0 and the newest 5.x):

* rotary settings written the installed release's way (4.57: GPT-NeoX's ``rotary_emb_base`` /
  ``rotary_pct``; 5.x: ``rope_parameters``) reach Hugging Face's model, are read back by
  `rope_parameters`, and a GPT-NeoX with a non-default base and rotary share replaced by SMP's
  distributed transformer gives Hugging Face's logits, loss and gradients (before, 4.57's
  ``rotary_emb_base`` was ignored and the replacement rotated with base 10000);
* a release older than the declared floor is refused by name in one line (also by ``import
  smdistributed.modelparallel.torch``), and that floor is pyproject.toml's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from smp2ds.engine.core.state import ModuleManager, state
from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.integrations import transformers_compat as compat
from smp2ds.engine.nn.huggingface import gptneox as tr
from smp2ds.engine.nn.parallel import marks
from smp2ds.engine.nn.parallel.context import ParallelContext
from smp2ds.engine.tensor_parallel.transformer_replacement import replace_marked
from tests.engine.hf_equivalence import assert_same_logits_loss_and_gradients

pytest.importorskip("transformers")

VOCAB, THETA, SHARE = 40, 500.0, 0.5


def _neox(seed: int) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                           vocab_size=VOCAB, max_position_embeddings=16,
                           **compat.rope_config_kwargs("gpt_neox", THETA, SHARE))
    cfg._attn_implementation = "eager"
    return tf.GPTNeoXForCausalLM(cfg)


def test_rotary_settings_reach_the_hf_model_and_are_read_back() -> None:
    model = _neox(0)
    rope = compat.rope_parameters(model.config)
    assert (rope["rope_type"], rope["rope_theta"], rope["partial_rotary_factor"]) == ("default", THETA, SHARE)
    # Hugging Face's own rotary embedding: head size 8, half of it rotated -> 2 frequencies of base 500
    # the base model's rotary embedding (4.45 on), or each attention layer's (4.44)
    rotary = getattr(model.gpt_neox, "rotary_emb", None) or model.gpt_neox.layers[0].attention.rotary_emb
    inv_freq = rotary.inv_freq
    torch.testing.assert_close(inv_freq, 1.0 / THETA ** (torch.arange(0, 4, 2, dtype=torch.float) / 4))


def test_replaced_neox_with_non_default_rotary_gives_hf_logits_loss_and_gradients(monkeypatch) -> None:
    monkeypatch.setattr(state, "module_manager", ModuleManager())
    with marks.tensor_parallelism(fused_softmax=True):
        net = _neox(4)
    ref = _neox(4)
    new = replace_marked(net, ParallelContext())
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    assert_same_logits_loss_and_gradients(new, ref, ids, mask,
                                          lambda sd: tr.translate_hf_state_dict_to_smdistributed_gptneox(sd, 4))


REFUSAL = (r"^transformers==4\.40\.2 is not supported by smp2ds; allowed: transformers>=4\.41\.0 \(4\.x from 4\.41, "
           r"and 5\.x\): pip install 'transformers>=4\.41\.0'$")


def test_release_older_than_the_floor_is_refused_by_name(monkeypatch) -> None:
    compat.require_supported_transformers()  # the installed release is supported
    monkeypatch.setattr(compat, "transformers_version", lambda: Version("4.40.2"))
    with pytest.raises(SMPUnsupportedError, match=REFUSAL):
        compat.require_supported_transformers()


def test_import_of_smdistributed_refuses_a_release_older_than_the_floor_in_one_line(monkeypatch) -> None:
    """``import smdistributed.modelparallel.torch`` installs the Trainer repairs, which first check the release:
    below the floor it stops with one line naming the supported range (4.40 is the newest line refused)."""
    from smp2ds.engine.api import hf_trainer_repairs

    monkeypatch.setattr(compat, "transformers_version", lambda: Version("4.40.2"))
    with pytest.raises(SMPUnsupportedError, match=REFUSAL) as err:
        hf_trainer_repairs.install_transformers_repairs()
    assert "\n" not in str(err.value)


def test_declared_floor_is_the_one_pyproject_declares() -> None:
    text = (Path(__file__).parents[3] / "pyproject.toml").read_text()  # tomllib needs Python 3.11
    floors = re.findall(r'^\s*"transformers\s*>=\s*([0-9.]+)"', text, flags=re.MULTILINE)
    assert [Version(f) for f in floors] == [compat.TRANSFORMERS_FLOOR]
