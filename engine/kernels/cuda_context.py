"""What the GPU backends (GPU prefill, the GPU vision tower) share: GPU 0's primary CUDA context, the counted
device allocations made in it, the guard that turns CUDA failures into :class:`~engine.errors.DeviceError`,
and the release of all of it.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from engine.errors import DeviceError

from .cuda_buffers import Device
from .cuda_kernels import load_driver


class CudaBackend:
    """Base of a GPU backend: holds GPU 0's primary context and a :class:`~engine.kernels.cuda_buffers.Device`.

    A subclass sets up its own attributes, then loads through :meth:`_open`, and frees what it holds
    besides device memory in :meth:`_release`.

    Raises:
        DeviceError: no usable GPU or pycuda, or the context cannot be created.
    """

    OOM_HINT = ""
    """Appended to the out-of-GPU-memory message (what the user can do about it), or ""."""

    def __init__(self) -> None:
        self._drv = load_driver()
        try:
            self._ctx = self._drv.Device(0).retain_primary_context()
        except self._drv.Error as e:
            raise DeviceError(f"CUDA context creation failed: {e}") from e
        self._dev = Device(self._drv)

    def _open(self, what: str, load: Callable[[], None]) -> None:
        """Run ``load()`` under :meth:`_guard`; on any exception (KeyboardInterrupt included) :meth:`close`
        first, then re-raise it.

        Raises:
            DeviceError: a CUDA or host-memory failure in ``load`` (see :meth:`_guard`); anything else
                ``load`` raises passes through unchanged.
        """
        try:
            with self._guard(what):
                load()
        except BaseException:
            self.close()
            raise

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """Make the context current for the block and turn CUDA / host-memory failures into DeviceError."""
        drv = self._drv
        self._ctx.push()
        try:
            yield
        except drv.MemoryError as e:
            raise DeviceError(f"out of GPU memory while {what}: {e}{self.OOM_HINT}") from e
        except drv.Error as e:
            raise DeviceError(f"CUDA error while {what}: {e}") from e
        except MemoryError as e:
            raise DeviceError(f"out of host memory for pinned buffers while {what}") from e
        finally:
            drv.Context.pop()

    def _release(self) -> None:
        """Drop what the backend holds besides device memory (pinned buffers, worker threads); called by
        :meth:`close` with the context current, before the device memory is freed. Nothing by default."""

    def close(self) -> None:
        """Free all device and pinned memory and release the context. The object is unusable afterwards;
        closing again does nothing."""
        if getattr(self, "_ctx", None) is None:
            return
        self._ctx.push()
        try:
            self._release()
            self._dev.free_all()
        finally:
            self._drv.Context.pop()
            self._ctx.detach()
            self._ctx = None
