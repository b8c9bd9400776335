"""A Hugging Face ``Trainer`` script written as SMP-era scripts are: nothing in it knows about
SageMaker model parallelism. Launched with the SMP environment (``SM_HP_MP_PARAMETERS``,
``SM_FRAMEWORK_PARAMS``), transformers takes its SMP code path on smp2ds; launched plainly, it is
the single-process reference.

Tiny GPT-2 from a config, synthetic token data; trains (optionally resuming from a checkpoint),
evaluates with per-sample metrics, saves the model, and writes what it saw to
``rank<RANK>.json`` (in ``$SMP2DS_SCRIPT_OUT``, else the output directory) for the test.
"""

import argparse
import json
import os
import sys

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

VOCAB, SEQ = 64, 8


class SyntheticLM(torch.utils.data.Dataset):
    """Random token sequences; the labels are the inputs (the model shifts them). The first label
    is never predicted; marking it -100 keeps the Trainer's token count (num_items_in_batch)
    equal to the number of predicted tokens."""

    def __init__(self, n, seed):
        self.tokens = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        labels = self.tokens[i].clone()
        labels[0] = -100
        return {"input_ids": self.tokens[i], "labels": labels}


def per_sample_nll(logits, labels):
    """Shrinks the logits to one number per sample (mean next-token NLL) before they are gathered."""
    logits = logits[0] if isinstance(logits, tuple) else logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2).float(), labels[:, 1:],
                                            reduction="none")
    return nll.mean(dim=1)


def compute_metrics(prediction):
    nll, labels = np.asarray(prediction.predictions), np.asarray(prediction.label_ids)
    order = np.arange(1, len(nll) + 1)
    return {"samples": len(nll), "nll_mean": float(nll.mean()), "nll_by_position": float((nll * order).sum()),
            "labels_by_position": int((labels[:, 1:].sum(axis=1) * order).sum())}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--save_steps", type=int, default=2)
    parser.add_argument("--optim", default="adamw_torch")
    parser.add_argument("--learning_rate", type=float, default=1e-2)
    parser.add_argument("--resume_from_checkpoint", default=None)
    cli = parser.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=cli.output_dir, use_cpu=True, per_device_train_batch_size=cli.per_device_train_batch_size,
        per_device_eval_batch_size=4, max_steps=cli.max_steps, learning_rate=cli.learning_rate, optim=cli.optim,
        # eps 1e-4: GPT-2's attention key bias has an analytically zero gradient (rounding noise
        # whose sign depends on summation order); Adam with eps 1e-8 would turn it into lr-sized steps.
        adam_epsilon=1e-4, weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="linear",
        logging_steps=1, save_strategy="steps", save_steps=cli.save_steps, report_to=[], seed=0,
        dataloader_pin_memory=False, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=SyntheticLM(64, seed=1),
                      eval_dataset=SyntheticLM(20, seed=2), compute_metrics=compute_metrics,
                      preprocess_logits_for_metrics=per_sample_nll)
    trainer.train(resume_from_checkpoint=cli.resume_from_checkpoint)
    metrics = trainer.evaluate()
    trainer.save_model(os.path.join(cli.output_dir, "final"))

    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    result = {
        "log_history": trainer.state.log_history, "eval": metrics,
        "world_size": args.world_size, "process_index": args.process_index, "device": str(args.device),
        "parallel_mode": str(args.parallel_mode), "model_class": type(trainer.model_wrapped).__name__,
        "optimizer_class": type(trainer.optimizer).__name__,
        "optimizer_steps": sorted({int(s["step"]) for s in inner.state.values() if "step" in s}),
        "smp_imported": sorted({m.split(".")[0] for m in sys.modules if m.split(".")[0] in ("smp2ds", "smdistributed")}),
    }
    out = os.environ.get("SMP2DS_SCRIPT_OUT", cli.output_dir)  # set by the test harness
    with open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
