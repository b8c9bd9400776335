"""Measuring a real step's peak: the bytes of live tensor storages, counted as they are made and freed.

`LiveTensorBytes` is a ``TorchDispatchMode``: every operator's output storage is counted once when first
seen and uncounted when Python frees it (a weak reference's callback), and the peak of the running sum is
kept. It installs no module or gradient hooks, so it keeps nothing alive itself (PyTorch's ``MemTracker``
holds freed tensors in reference cycles until the garbage collector runs, which doubled a 2 GB DeepSpeed
bucket at random). Storages resized in place (``UntypedStorage.resize_``) are counted at their first size;
DeepSpeed 0.19.8's ZeRO-3 resizes none (it frees a gathered parameter by replacing ``param.data`` with an empty
tensor), so sharded data parallelism is counted exactly too.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages made inside the block; ``peak`` is the largest sum seen."""

    def __init__(self) -> None:
        super().__init__()
        # Storages are also freed on other threads (collective work handles, autograd): the running sum is
        # updated under a lock, or a free interleaved with a count is lost and the figure drifts upwards.
        self._lock = threading.RLock()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}

    def _on_free(self, key: int, _ref: weakref.ref) -> None:
        self._freed(key)

    def _freed(self, key: int) -> None:
        with self._lock:
            self.live -= self._sizes.pop(key, 0)
            self._refs.pop(key, None)

    def _count(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        with self._lock:
            if key in self._sizes:
                return
            size = storage.nbytes()
            self._sizes[key] = size
            self._refs[key] = weakref.ref(storage, functools.partial(self._on_free, key))
            self.live += size
            self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self._count(item)
        return out
