"""``smp.nn.huggingface.gptneox`` (re-exported from ``smp2ds.engine.nn.huggingface.gptneox``)."""

from smp2ds.engine.nn.huggingface.gptneox import (  # noqa: F401
    translate_hf_gptneox_state_dict_to_smdistributed,
    translate_hf_state_dict_to_smdistributed_gptneox,
    translate_state_dict_to_hf_gptneox,
)
