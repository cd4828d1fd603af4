"""Device-side plumbing of GPU prefill: counted device allocations, the activation
arena of one pass, and the worker thread that issues the expert copies.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import numpy as np

from .cuda_layout import ALIGN, aligned


class Device:
    """Device allocations of one engine, counted (bytes rounded to :data:`ALIGN`)."""

    def __init__(self, drv: Any) -> None:
        self.drv = drv
        self.blocks: dict[int, Any] = {}
        self.sizes: dict[int, int] = {}

    def alloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` (>= 1) and return the device pointer."""
        block = self.drv.mem_alloc(max(aligned(nbytes), ALIGN))
        ptr = int(block)
        self.blocks[ptr] = block
        self.sizes[ptr] = max(aligned(nbytes), ALIGN)
        return ptr

    def upload(self, array: np.ndarray) -> int:
        """Allocate and copy a host array (synchronous); returns the device pointer."""
        array = np.ascontiguousarray(array)
        ptr = self.alloc(array.nbytes)
        self.drv.memcpy_htod(ptr, array)
        return ptr

    def free(self, ptr: int) -> None:
        """Free one allocation."""
        self.blocks.pop(ptr).free()
        self.sizes.pop(ptr)

    def free_all(self) -> None:
        """Free everything."""
        for ptr in list(self.blocks):
            self.free(ptr)

    @property
    def used(self) -> int:
        """Bytes allocated."""
        return sum(self.sizes.values())


class CopyTask:
    """One queued host -> device copy job; ``queued`` is set once the worker has issued it (or failed)."""

    def __init__(self, run: Callable[[], None]) -> None:
        self.run = run
        self.queued = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> None:
        """Block until the copies are queued on the GPU; re-raise the worker's error."""
        self.queued.wait()
        if self.error is not None:
            raise self.error


class Copier:
    """Issues the expert copies from a thread of its own, so the thread that queues compute never waits in a
    copy call (CUDA documents that any call, async copies included, may block on internal resources).
    Design: docs/design/gpu-prefill.md ("The copy worker").
    """

    def __init__(self, drv: Any, ctx: Any) -> None:
        self._drv, self._ctx = drv, ctx
        self._jobs: queue.Queue[CopyTask | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="deltadesk-h2d", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        self._ctx.push()
        try:
            while (task := self._jobs.get()) is not None:
                try:
                    task.run()
                except BaseException as e:  # handed to the waiting thread
                    task.error = e
                finally:
                    task.queued.set()
        finally:
            self._drv.Context.pop()

    def submit(self, run: Callable[[], None]) -> CopyTask:
        """Queue ``run`` (which issues async copies) on the worker; returns its task."""
        task = CopyTask(run)
        self._jobs.put(task)
        return task

    def close(self) -> None:
        """Stop the worker after the queued jobs."""
        self._jobs.put(None)
        self._thread.join()


class Activations:
    """One allocation holding an architecture's activation buffers for ``capacity`` tokens; ``ptr[name]`` per buffer.

    Args:
        dev: the device to allocate on.
        groups: group -> buffer name -> bytes (e.g. :func:`engine.arch.qwen35.cuda_plan.activation_groups`):
            the ``"base"`` group is live throughout a layer; the other groups are live one at a time,
            so they share the space after it.
        capacity: tokens per pass the sizes were computed for.
    """

    def __init__(self, dev: Device, groups: dict[str, dict[str, int]], capacity: int) -> None:
        offsets: dict[str, int] = {}
        off = 0
        for name, nbytes in groups["base"].items():
            offsets[name] = off
            off += aligned(nbytes)
        top = off
        for group, bufs in groups.items():
            if group == "base":
                continue
            o = off
            for name, nbytes in bufs.items():
                offsets[name] = o
                o += aligned(nbytes)
            top = max(top, o)
        self.capacity = capacity
        self.base = dev.alloc(top)
        self.ptr = {name: self.base + o for name, o in offsets.items()}
