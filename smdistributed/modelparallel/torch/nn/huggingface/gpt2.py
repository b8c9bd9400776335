"""``smp.nn.huggingface.gpt2`` (re-exported from ``smp2ds.engine.nn.huggingface.gpt2``)."""

from smp2ds.engine.nn.huggingface.gpt2 import (  # noqa: F401
    translate_hf_state_dict_to_smdistributed,
    translate_hf_state_dict_to_smdistributed_gpt2,
    translate_hf_state_dict_to_smdistributed_gpt2_layer,
    translate_state_dict_to_hf_gpt2,
    translate_state_dict_to_hf_gpt2_layer,
)
