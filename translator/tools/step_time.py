"""Time of one optimizer step of a layout, by formula: what ``explain --fit`` ranks the layouts that fit by.

Terms (no overlap of compute and communication is assumed, so each term is what it costs when it is not hidden):

* **compute**: ``6 N T`` floating-point operations per step for ``N`` parameters and ``T`` tokens (forward 2,
  backward 4), ``8 N T`` with activation checkpointing (the forward again), split over the ranks that share the
  work: a rank computes its ``1 / pp`` of the layers on its own batch, and a tensor-parallel group without SMP's
  ``prescaled_batch`` joins its ranks' batches, so each rank does its ``1 / tp`` of the layers on ``tp`` batches
  (the same work as alone); with ``prescaled_batch`` the group shares one batch;
* **pipeline bubble**: a 1F1B pipeline of ``p`` stages and ``m`` micro-batches idles ``(p - 1) / m`` of its
  compute;
* **data-parallel traffic**: the bytes ``tools/estimate.py`` counts for the plan's scheme, in the node and across
  nodes, at each link's rate, plus a latency per ring step (what makes a small model's all-reduce cost more than
  its bytes);
* **tensor-parallel traffic**: the all-reduces of ``tools/tp_traffic.py``, inside a node;
* **pipeline sends**: each micro-batch's activations (``batch x sequence x hidden``) sent forward and their
  gradients sent back, across nodes when a model replica (``tp x pp`` ranks) spans nodes, a latency per send.

Layouts are compared by **time per sample**: the step's seconds over the samples the whole job trains on in it
(every model replica's batch: ``world / pp`` ranks read their own rows, ``world / (pp x tp)`` with
``prescaled_batch``), since a pipeline or a tensor-parallel group spends its ranks on fewer replicas.

The device rates are a named assumption (:data:`REFERENCE_DEVICE`), the same for every layout: the ranking and the
deciding term matter, not the seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DeviceRates:
    """Sustained rates of one rank."""

    flops: float
    """Floating-point operations per second."""
    in_node_bytes: float
    """Bytes per second one rank sends to ranks of its node."""
    cross_node_bytes: float
    """Bytes per second one rank sends to other nodes."""
    in_node_latency: float
    """Seconds of one message (one ring step, one send) inside a node, whatever its size."""
    cross_node_latency: float
    label: str


REFERENCE_DEVICE = DeviceRates(flops=300e12, in_node_bytes=150e9, cross_node_bytes=25e9, in_node_latency=10e-6,
                               cross_node_latency=20e-6,
                               label="300 TFLOP/s sustained, 150 GB/s per rank in a node and 25 GB/s across nodes, "
                                     "10 and 20 us per message (an 8-GPU H100-class node)")


@dataclass(frozen=True)
class StepWork:
    """What one rank does and sends in a step."""

    parameters: float
    tokens_per_rank: int
    """Batch x sequence handed to the step on one rank."""
    tensor_parallel: int
    pipeline_stages: int
    microbatches: int
    prescaled_batch: bool
    activation_checkpointing: bool
    data_parallel_in_node_bytes: float
    data_parallel_cross_node_bytes: float
    tensor_parallel_bytes: float
    pipeline_send_bytes: float
    pipeline_crosses_nodes: bool
    data_parallel_in_node_messages: int = 0
    """Ring steps of the data-parallel collectives inside a node (each costs the latency)."""
    data_parallel_cross_node_messages: int = 0
    tensor_parallel_messages: int = 0
    pipeline_messages: int = 0
    samples_per_step: int = 1
    """Samples the whole job trains on in one step."""


def step_time(work: StepWork, device: DeviceRates = REFERENCE_DEVICE) -> dict[str, Any]:
    """Seconds per term and in all, per sample of the job, and the term that decides (JSON-ready)."""
    passes = 8 if work.activation_checkpointing else 6
    rows = work.tokens_per_rank * (1 if work.prescaled_batch else work.tensor_parallel)
    flops = passes * work.parameters * rows / (work.tensor_parallel * work.pipeline_stages)
    compute = flops / device.flops
    pipe_rate, pipe_latency = ((device.cross_node_bytes, device.cross_node_latency) if work.pipeline_crosses_nodes
                               else (device.in_node_bytes, device.in_node_latency))
    terms = {
        "compute": compute,
        "pipeline bubble": compute * (work.pipeline_stages - 1) / work.microbatches,
        "data-parallel traffic": (work.data_parallel_in_node_bytes / device.in_node_bytes
                                  + work.data_parallel_cross_node_bytes / device.cross_node_bytes
                                  + work.data_parallel_in_node_messages * device.in_node_latency
                                  + work.data_parallel_cross_node_messages * device.cross_node_latency),
        "tensor-parallel traffic": (work.tensor_parallel_bytes / device.in_node_bytes
                                    + work.tensor_parallel_messages * device.in_node_latency),
        "pipeline sends": work.pipeline_send_bytes / pipe_rate + work.pipeline_messages * pipe_latency,
    }
    seconds = sum(terms.values())
    return {"seconds": seconds, "samples_per_step": work.samples_per_step,
            "seconds_per_sample": seconds / max(work.samples_per_step, 1), "terms": terms,
            "decided_by": max(terms, key=lambda name: terms[name]), "device": device.label}


def pipeline_send_bytes(*, stages: int, batch_per_rank: int, seq_len: int, hidden: int,
                        bytes_per_element: int) -> float:
    """Bytes a middle stage's rank sends per step: its batch's activations forward and their gradients back, over
    all micro-batches (a first or last stage sends half; the middle one is the slowest)."""
    if stages == 1:
        return 0.0
    return 2.0 * batch_per_rank * seq_len * hidden * bytes_per_element
