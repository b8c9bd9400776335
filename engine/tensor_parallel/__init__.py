"""Tensor parallelism (SMP ``tensor_parallel_degree > 1``), Megatron-style, on DeepSpeed.

* :mod:`collectives`: the autograd pairs (copy/reduce, gather/keep, batch join/slice) over ``comm``;
* :mod:`layers`: column/row-parallel ``nn.Linear`` and Hugging Face ``Conv1D``, sharded in place;
* :mod:`shards`: how a parameter is cut (fused q/k/v per block) and joined back;
* :mod:`region`: ``prescaled_batch`` semantics (join the group's batches, hand back own rows)
  and the group's random stream (:mod:`rng`, ``tensor_parallel_seed``);
* :mod:`families`: Hugging Face blocks sharded by structure (GPT-2, LLaMA/Mistral, BERT/RoBERTa,
  GPT-NeoX, GPT-J, GPT-Neo);
* :mod:`modules`: ``smp.nn.DistributedModule`` / ``DistributedLinear`` / ``DistributedEmbedding``;
* :mod:`registry`: ``smp.tensor_parallelism``, ``set_tensor_parallelism``, ``tp_register*`` and
  the replacement pass ``smp.DistributedModel`` runs;
* :mod:`grads`, :mod:`mpu`, :mod:`backend`: gradients, DeepSpeed's groups, the ``Backend``.
"""
