"""``smp.nn.huggingface.roberta`` (re-exported from ``smp2ds.engine.nn.huggingface.roberta``)."""

from smp2ds.engine.nn.huggingface.roberta import (  # noqa: F401
    translate_hf_state_dict_to_smdistributed_roberta,
    translate_state_dict_to_hf_roberta,
)
