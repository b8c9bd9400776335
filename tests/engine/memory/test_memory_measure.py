"""The two counters that measure a real step's peak (``smp2ds.engine.memory.measure``): PyTorch's CPU allocator
read from the profiler, with its correction for frees on threads the profiler does not record, and the live-tensor
counter's account of bytes freed on other threads."""

from __future__ import annotations

import threading

import torch

from smp2ds.engine.memory.measure import AllocatorPeak, LiveTensorBytes, allocator_peaks

MB = 1 << 20


def test_the_allocator_peak_is_the_largest_total_of_the_block():
    with AllocatorPeak() as count:
        first = torch.empty(MB // 4)  # 1 MiB of fp32
        second = torch.empty(MB // 2)  # 2 MiB: 3 MiB together
        del first, second
        third = torch.empty(MB // 2)
        del third
    assert count.peak == count.peak_corrected == 3 * MB and count.unseen_frees == 0


def test_a_reused_address_proves_an_unseen_free_and_is_subtracted_from_then_on():
    """Events (time, bytes, allocator total after, address): a 100-byte block at 0xA is freed on an unrecorded
    thread (no event, the total keeps it), then 0xA is handed out again: the block was free by then."""
    events = [(1, 100, 100, 0xA), (2, 50, 150, 0xB), (3, 100, 250, 0xA), (4, -50, 200, 0xB)]
    assert allocator_peaks(events) == (250, 150, 1)
    assert allocator_peaks([(1, 10, 10, 1), (2, -10, 0, 1), (3, 10, 10, 1)]) == (10, 10, 0)  # seen free: no reuse


def test_the_live_counter_names_the_threads_that_free():
    with LiveTensorBytes() as live:
        held = [torch.ones(1000)]
        other = threading.Thread(target=held.pop, name="not-the-trainer")
        other.start()
        other.join()
        kept = torch.ones(10)
    assert live.freed_elsewhere == {"not-the-trainer": 4000} and live.live == kept.numel() * 4
