"""``smp.nn.huggingface.gptneo`` (re-exported from ``smp2ds.engine.nn.huggingface.gptneo``)."""

from smp2ds.engine.nn.huggingface.gptneo import (  # noqa: F401
    translate_hf_gptneo_state_dict_to_smdistributed,
    translate_hf_state_dict_to_smdistributed_gptneo,
    translate_state_dict_to_hf_gptneo,
)
