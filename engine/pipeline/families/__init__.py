"""Built-in pipeline layer lists, registered with `smp2ds.engine.pipeline.layers.register_family`.

Order matters: the first family whose ``matches`` accepts a model builds its layer list.
"""

from smp2ds.engine.pipeline.families import (
    bert,
    bloom,
    gpt2,
    hf_decoder,
    opt,
    roberta,
    sequential,
    smp_transformer,
    t5,
    traced,
)
from smp2ds.engine.pipeline.layers import register_family

register_family("torch.nn.Sequential", sequential.matches, sequential.build)
register_family("transformers GPT2LMHeadModel", gpt2.matches, gpt2.build)
register_family("transformers BertForSequenceClassification / BertForQuestionAnswering / BertForMaskedLM",
                bert.matches, bert.build)
register_family(roberta.FAMILY, roberta.matches, roberta.build)  # BERT's machinery, RoBERTa's positions and heads
register_family(smp_transformer.FAMILY, smp_transformer.matches, smp_transformer.build)
register_family(opt.FAMILY, opt.matches, opt.build)  # learned positions from the mask, project_in/out
register_family(bloom.FAMILY, bloom.matches, bloom.build)  # ALiBi biases rebuilt on each stage
register_family(t5.FAMILY, t5.matches, t5.build)  # encoder then decoder stages, relative position bias tied per stack
# Any other *ForCausalLM (LLaMA included), cut by its decoder structure.
register_family(hf_decoder.FAMILY, hf_decoder.matches, hf_decoder.build)
register_family("torch.fx traced module", traced.matches, traced.build)  # last: takes any nn.Module
