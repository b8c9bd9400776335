"""``smp.nn.huggingface.gptj`` (re-exported from ``smp2ds.engine.nn.huggingface.gptj``)."""

from smp2ds.engine.nn.huggingface.gptj import (  # noqa: F401
    translate_hf_gptj_state_dict_to_smdistributed,
    translate_hf_state_dict_to_smdistributed_gptj,
    translate_state_dict_to_hf_gptj,
)
