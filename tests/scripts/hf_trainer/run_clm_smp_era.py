"""A causal-LM fine-tuning script shaped like SMP's Hugging Face Trainer example ``run_clm.py`` (the
transformers 4.x era): ``HfArgumentParser`` over model, data and ``TrainingArguments`` dataclasses,
``CONFIG_MAPPING[model_type]()`` + ``--config_overrides``, ``group_texts`` blocks, ``Trainer`` with
``compute_metrics`` / ``preprocess_logits_for_metrics`` unless on TPU, ``get_last_checkpoint``,
``save_model`` / ``log_metrics`` / ``save_metrics`` / ``save_state`` and the perplexity. Nothing in it
knows about SageMaker model parallelism: launched with the SMP environment, transformers takes its SMP
code path on smp2ds.

Guarded as users guarded them: ``is_torch_tpu_available`` (absent from 4.57 and 5.x: the script falls
back to ``is_torch_xla_available``, as HF's later examples use) and ``overwrite_output_dir`` (gone in
5.x). Three departures: the corpus is a seeded random token stream instead of ``datasets.load_dataset`` (no
network), the accuracy metric is computed with numpy instead of ``evaluate.load("accuracy")``, and
each block's first label is -100 (see `group_texts`). At the end, when ``SMP2DS_SCRIPT_OUT`` is set (the test harness), each
rank writes what it saw to ``rank<RANK>.json``.
"""

# ruff: noqa: UP045 - Optional[...] as the 4.x-era script wrote it (HfArgumentParser reads these annotations)
import json
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain
from typing import Optional

import numpy as np
import torch
import transformers
from transformers import (
    CONFIG_MAPPING,
    AutoModelForCausalLM,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

# As SMP-era scripts guarded it: later releases (4.57 and 5.x among them) only have the renamed check.
try:
    from transformers import is_torch_tpu_available
except ImportError:
    from transformers import is_torch_xla_available as is_torch_tpu_available

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_type: Optional[str] = field(default="gpt2", metadata={"help": "Model type to train from scratch."})
    config_overrides: Optional[str] = field(default=None, metadata={"help": "Override config settings: n_embd=10,..."})


@dataclass
class DataTrainingArguments:
    block_size: Optional[int] = field(default=8, metadata={"help": "Sequence length after tokenization."})
    corpus_tokens: int = field(default=2048, metadata={"help": "Tokens in the synthetic corpus."})
    max_train_samples: Optional[int] = field(default=64)
    max_eval_samples: Optional[int] = field(default=20)


def synthetic_corpus(tokens, vocab_size, seed):
    """Stands in for the tokenized dataset: documents of random token ids."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (tokens,), generator=generator).tolist()
    return {"input_ids": [ids[i:i + 100] for i in range(0, tokens, 100)]}


def group_texts(examples, block_size):
    # Concatenate all texts, drop the small remainder, split into blocks (as run_clm.py does).
    concatenated = {k: list(chain(*examples[k])) for k in examples}
    total_length = len(concatenated[list(examples.keys())[0]])
    total_length = (total_length // block_size) * block_size
    result = {k: [t[i:i + block_size] for i in range(0, total_length, block_size)] for k, t in concatenated.items()}
    # run_clm.py copies input_ids; the first label of a block is never predicted, and marking it -100
    # keeps the plain Trainer's token count (num_items_in_batch, which divides its loss) equal to the
    # predicted tokens. transformers' SMP path, like SMP's, takes the model's own mean loss.
    result["labels"] = [[-100] + block[1:] for block in result["input_ids"]]
    return [dict(zip(result, values)) for values in zip(*result.values())]


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        datefmt="%m/%d/%Y %H:%M:%S", handlers=[logging.StreamHandler(sys.stdout)])
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    logger.warning(f"Process rank: {training_args.local_rank}, device: {training_args.device}, "
                   f"n_gpu: {training_args.n_gpu}, parallel mode: {training_args.parallel_mode}")

    # Detecting last checkpoint. (transformers 5 dropped overwrite_output_dir: read it guarded.)
    last_checkpoint = None
    overwrite_output_dir = getattr(training_args, "overwrite_output_dir", False)
    if os.path.isdir(training_args.output_dir) and training_args.do_train and not overwrite_output_dir:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
        if last_checkpoint is not None and training_args.resume_from_checkpoint is None:
            logger.info(f"Checkpoint detected, resuming training at {last_checkpoint}.")

    set_seed(training_args.seed)

    config = CONFIG_MAPPING[model_args.model_type]()
    if model_args.config_overrides is not None:
        config.update_from_string(model_args.config_overrides)
    model = AutoModelForCausalLM.from_config(config)
    n_params = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
    logger.info(f"Training new model from scratch - Total size={n_params / 2 ** 20:.2f}M params")

    block_size = data_args.block_size
    train_dataset = group_texts(synthetic_corpus(data_args.corpus_tokens, config.vocab_size, 1), block_size)
    eval_dataset = group_texts(synthetic_corpus(data_args.corpus_tokens, config.vocab_size, 2), block_size)
    train_dataset = train_dataset[:data_args.max_train_samples]
    eval_dataset = eval_dataset[:data_args.max_eval_samples]

    def preprocess_logits_for_metrics(logits, labels):
        if isinstance(logits, tuple):
            # Depending on the model and config, logits may contain extra tensors, like past_key_values.
            logits = logits[0]
        return logits.argmax(dim=-1)

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        # preds have the same shape as the labels, after the argmax(-1) has been calculated
        # by preprocess_logits_for_metrics but we need to shift the labels
        labels = labels[:, 1:].reshape(-1)
        preds = preds[:, :-1].reshape(-1)
        return {"accuracy": float(np.mean(preds == labels)), "predictions_checksum": int(preds.sum())}

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        data_collator=default_data_collator,
        compute_metrics=compute_metrics if training_args.do_eval and not is_torch_tpu_available() else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics
        if training_args.do_eval and not is_torch_tpu_available() else None,
    )

    if training_args.do_train:
        checkpoint = None
        if training_args.resume_from_checkpoint is not None:
            checkpoint = training_args.resume_from_checkpoint
        elif last_checkpoint is not None:
            checkpoint = last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()  # Saves the tokenizer too for easy upload

        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        try:
            perplexity = math.exp(metrics["eval_loss"])
        except OverflowError:
            perplexity = float("inf")
        metrics["perplexity"] = perplexity
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    out = os.environ.get("SMP2DS_SCRIPT_OUT")  # the test harness only
    if out:
        seen = {"parallel_mode": str(training_args.parallel_mode), "world_size": training_args.world_size,
                "model_class": type(trainer.model_wrapped).__name__, "tpu_check": is_torch_tpu_available.__name__,
                "transformers": transformers.__version__, "log_history": trainer.state.log_history}
        with open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump(seen, f)


if __name__ == "__main__":
    main()
