"""``smp.nn.huggingface.bert`` (re-exported from ``smp2ds.engine.nn.huggingface.bert``)."""

from smp2ds.engine.nn.huggingface.bert import (  # noqa: F401
    translate_hf_state_dict_to_smdistributed_bert,
    translate_state_dict_to_hf_bert,
)
