"""Worker threads for numpy work that many small GEMMs dominate (the vision towers): a shared task
counter over the calling thread and helpers, with BLAS held to one thread on each of them.
"""

from __future__ import annotations

import ctypes
import glob
import itertools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def blas_thread_setter() -> Callable[[int], int] | None:
    """OpenBLAS's ``openblas_set_num_threads_local(n) -> previous``, which sets the BLAS thread count of
    the calling thread only, from the OpenBLAS that numpy's wheels bundle (scipy-openblas >= 0.3.27,
    under ``numpy.libs`` or ``numpy/.dylibs``; loading it again returns the instance numpy uses).
    None when numpy uses another BLAS or an older OpenBLAS."""
    base = os.path.dirname(os.path.abspath(np.__file__))
    for path in sorted(glob.glob(os.path.join(base + ".libs", "*openblas*"))
                       + glob.glob(os.path.join(base, ".dylibs", "*openblas*"))):
        try:
            fn = ctypes.CDLL(path).openblas_set_num_threads_local
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


class Workers:
    """Runs independent tasks on the calling thread plus ``n - 1`` helper threads, each task once.

    Tasks are pulled one at a time from a shared counter, so a core slowed by another process simply
    takes fewer of them. Inside :meth:`run` every participating thread runs BLAS single-threaded
    (``set_blas_threads``), so the parallelism is ours: many small GEMMs (attention) and the
    elementwise numpy passes, which are single-threaded anyway, use every core. Without a BLAS
    thread control there is one worker: the caller, with BLAS threaded as configured.

    Args:
        n: worker count wanted (the caller included), >= 1.
        set_blas_threads: :func:`blas_thread_setter`'s function, or None.
    """

    def __init__(self, n: int, set_blas_threads: Callable[[int], int] | None):
        self.n = max(1, int(n)) if set_blas_threads is not None else 1
        self._set_blas = set_blas_threads
        self._pool = (ThreadPoolExecutor(self.n - 1, thread_name_prefix="vision",
                                         initializer=set_blas_threads, initargs=(1,)) if self.n > 1 else None)

    def run(self, task: Callable[[int], None], n_tasks: int) -> None:
        """Call ``task(i)`` for every i in ``range(n_tasks)``, in parallel; returns when all are done.

        Raises:
            whatever a task raised (the first seen by the caller; the other workers finish first).
        """
        counter = itertools.count()

        def drain() -> None:
            i = next(counter)
            while i < n_tasks:
                task(i)
                i = next(counter)

        if self._pool is None or n_tasks == 1:
            drain()
            return
        helpers = [self._pool.submit(drain) for _ in range(min(self.n, n_tasks) - 1)]
        prev = self._set_blas(1)
        try:
            drain()
        finally:
            self._set_blas(prev)
            errors = [f.exception() for f in helpers]
        for err in errors:
            if err is not None:
                raise err
