"""Offline tools for SMP / smp2ds checkpoints: no process group, no GPU.

* :mod:`.reading`     -- safe loading (``weights_only``, memory-mapped); every failure names its file.
* :mod:`.layout`      -- which files a checkpoint folder holds, its degrees, tag and what is missing.
* :mod:`.shard_rules` -- how a tensor-parallel piece sits in its full tensor, from names and contents.
* :mod:`.inspect`     -- the ``smp2ds checkpoint inspect`` report.
* :mod:`.consolidate` -- partial files -> one full state dict, streamed tensor by tensor.
* :mod:`.safetensors_stream` -- a safetensors file written one tensor at a time.
* :mod:`.hf_export`   -- a consolidated state dict -> a Hugging Face model directory.
* :mod:`.commands`    -- the entry points the ``smp2ds checkpoint`` CLI calls.
"""
