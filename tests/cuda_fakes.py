"""An emulated CUDA device for CudaPrefill's host side (runs everywhere; the GPU prefill and vision tests).

A stand-in for pycuda.driver (device memory = numpy byte arrays behind integer addresses, bounds
checked; streams and events run eagerly) and for the Kernels class (each launch = the numpy twin
from engine.ops.reference on those arrays). It exercises everything CudaPrefill does on the host:
placement, buffer offsets, streaming bookkeeping, routing tables, passes and the state hand-off.
"""

from __future__ import annotations

import bisect

import numpy as np

from engine.kernels.moe_stream import route_tables
from engine.kernels.cuda_layout import TILE_ROWS


class _FakeError(Exception):
    pass


class _FakeMemoryError(_FakeError):
    pass


class _FakeMem:
    def __init__(self) -> None:
        self.blocks: dict[int, np.ndarray] = {}
        self.next = 1 << 20

    def alloc(self, n: int) -> int:
        base = self.next
        self.next += -(-n // 4096) * 4096 + 4096
        self.blocks[base] = np.full(n, 0xFF, np.uint8)  # poison: NaN as float32
        return base

    def view(self, ptr: int, nbytes: int) -> np.ndarray:
        bases = sorted(self.blocks)
        base = bases[bisect.bisect_right(bases, ptr) - 1]
        off = ptr - base
        block = self.blocks[base]
        assert 0 <= off and off + nbytes <= block.size, f"device access {ptr:#x}+{nbytes} outside its allocation"
        return block[off:off + nbytes]

    def arr(self, ptr: int, shape, dtype=np.float32) -> np.ndarray:
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        return self.view(ptr, count * dtype.itemsize).view(dtype).reshape(shape)

    def rows(self, ptr: int, index, stride: int, width: int) -> np.ndarray:
        """Rows ``index`` of a (., stride) float32 matrix at ptr, first ``width`` columns (a view when consecutive)."""
        index = np.asarray(index)
        if index.size and np.all(np.diff(index) == 1):
            n = index.size
            return self.arr(ptr + int(index[0]) * stride * 4, ((n - 1) * stride + width,)).reshape(-1)[
                np.arange(n)[:, None] * stride + np.arange(width)]
        return np.stack([self.arr(ptr + int(i) * stride * 4, (width,)) for i in index])


class _FakeAlloc:
    def __init__(self, mem: _FakeMem, n: int) -> None:
        self.mem, self.ptr = mem, mem.alloc(n)

    def __int__(self) -> int:
        return self.ptr

    def free(self) -> None:
        del self.mem.blocks[self.ptr]


class _FakeEvent:
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def time_till(self, other) -> float:
        return 0.0


class _FakeStream:
    def synchronize(self) -> None:
        pass

    def wait_for_event(self, ev) -> None:
        pass


class _FakeContext:
    stack: list = []

    def push(self) -> None:
        _FakeContext.stack.append(self)

    @staticmethod
    def pop() -> None:
        _FakeContext.stack.pop()

    def detach(self) -> None:
        pass


class FakeDriver:
    """The subset of pycuda.driver that CudaPrefill uses."""

    Error, MemoryError, Event, Stream, Context = _FakeError, _FakeMemoryError, _FakeEvent, _FakeStream, _FakeContext

    def __init__(self, free: int = 8 << 30) -> None:
        self.mem = _FakeMem()
        self.free = free

    class Device:
        def __init__(self, i: int) -> None:
            pass

        def retain_primary_context(self):
            return _FakeContext()

    def mem_get_info(self):
        return self.free, 16 << 30

    def mem_alloc(self, n: int) -> _FakeAlloc:
        assert _FakeContext.stack, "allocation without a current context"
        return _FakeAlloc(self.mem, n)

    def pagelocked_empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def memcpy_htod(self, ptr, a) -> None:
        a = np.ascontiguousarray(a)
        self.mem.view(int(ptr), a.nbytes)[:] = a.reshape(-1).view(np.uint8)

    def memcpy_dtoh(self, a, ptr) -> None:
        a.reshape(-1).view(np.uint8)[:] = self.mem.view(int(ptr), a.nbytes)

    def memcpy_htod_async(self, ptr, a, stream) -> None:
        self.memcpy_htod(ptr, a)

    def memcpy_dtoh_async(self, a, ptr, stream) -> None:
        self.memcpy_dtoh(a, ptr)

    def memcpy_dtod_async(self, dst, src, n, stream) -> None:
        self.mem.view(int(dst), n)[:] = self.mem.view(int(src), n)


class FakeKernels:
    """engine.kernels.cuda_kernels.Kernels with each kernel replaced by its numpy twin."""

    def __init__(self, drv: FakeDriver, sources: tuple[str, ...]) -> None:
        self.m = drv.mem
        self.sources = sources

    def gemm(self, stream, w, w_ptr, a, lda, c, ldc, m, *, a_rows=0, tiles=0, n_tiles=0, n_tiles_dev=0, c_rows=0,
             row_scale=0, accumulate=False):
        from engine.gguf.quant import dequantize

        M = self.m
        if tiles:
            count = int(M.arr(n_tiles_dev, (1,), np.int32)[0]) if n_tiles_dev else n_tiles
            assert count <= n_tiles
            todo = M.arr(tiles, (count, 3), np.int64)
        else:
            todo = [(s, min(64, m - s), 0) for s in range(0, m, 64)]
        for start, count, off in todo:
            r = np.arange(start, start + count)
            src = M.arr(a_rows, (m,), np.int32)[r] if a_rows else r
            x = M.rows(a, src, lda, w.cols)
            wd = dequantize(M.view(w_ptr + int(off), w.rows * w.row_bytes).reshape(w.rows, w.row_bytes), w.qtype,
                            (w.rows, w.cols))
            out = x @ wd.T
            if row_scale:
                out = out * M.arr(row_scale, (m,))[r][:, None]
            dst = M.arr(c_rows, (m,), np.int32)[r] if c_rows else r
            if accumulate:
                out = out + M.rows(c, dst, ldc, w.rows)
            for i, row in zip(dst, out):
                M.arr(c + int(i) * ldc * 4, (w.rows,))[:] = row

    def gemv(self, stream, w, w_ptr, x, y):
        from engine.gguf.quant import dequantize

        wd = dequantize(self.m.view(w_ptr, w.rows * w.row_bytes).reshape(w.rows, w.row_bytes), w.qtype,
                        (w.rows, w.cols))
        self.m.arr(y, (w.rows,))[:] = wd @ self.m.arr(x, (w.cols,))

    def embed(self, stream, qtype, rows, row_bytes, out, n, k):
        from engine.gguf.quant import dequantize

        self.m.arr(out, (n, k))[:] = dequantize(self.m.view(rows, n * row_bytes).reshape(n, row_bytes), qtype, (n, k))

    def rmsnorm(self, stream, x, x_stride, w, y, y_stride, rows, d, eps):
        from engine.ops import reference as ops

        out = ops.rmsnorm(self.m.rows(x, range(rows), x_stride, d), self.m.arr(w, (d,)), eps)
        for i in range(rows):
            self.m.arr(y + i * y_stride * 4, (d,))[:] = out[i]

    def qk_norm_rope(self, stream, x, x_row, x_head, w, pos, n, heads, hd, rope_dims, theta, sections, eps, y,
                     y_row, y_head):
        from engine.ops import reference as ops

        xs = np.stack([self.m.rows(x + t * x_row * 4, range(heads), x_head, hd) for t in range(n)])
        out = ops.rope_multi(ops.rmsnorm(xs, self.m.arr(w, (hd,)), eps), self.m.arr(pos, (3, n), np.int32),
                             rope_dims, theta, sections)
        for t in range(n):
            for h in range(heads):
                self.m.arr(y + (t * y_row + h * y_head) * 4, (hd,))[:] = out[t, h]

    def conv1d_silu(self, stream, mixed, state_in, w, u, n, c, k):
        from engine.ops import reference as ops

        y, _ = ops.causal_conv1d(self.m.arr(mixed, (n, c)), self.m.arr(w, (c, k)), self.m.arr(state_in, (k - 1, c)))
        self.m.arr(u, (n, c))[:] = ops.silu(y)

    def conv_state_update(self, stream, mixed, state_in, state_out, n, c, k):
        from engine.ops import reference as ops

        _, s = ops.causal_conv1d(self.m.arr(mixed, (n, c)), np.zeros((c, k), np.float32),
                                 self.m.arr(state_in, (k - 1, c)))
        self.m.arr(state_out, (k - 1, c))[:] = s

    def l2norm_qk(self, stream, u, n, c, nk, dk, eps, q_scale):
        from engine.ops import reference as ops

        x = self.m.arr(u, (n, c))
        x[:, :nk * dk] = (ops.l2norm(x[:, :nk * dk].reshape(n, nk, dk), eps) * np.float32(q_scale)).reshape(n, -1)
        x[:, nk * dk:2 * nk * dk] = ops.l2norm(x[:, nk * dk:2 * nk * dk].reshape(n, nk, dk), eps).reshape(n, -1)

    def gdn_gates(self, stream, braw, araw, ssm_a, dt_bias, beta, g, n, nv):
        from engine.ops import reference as ops

        self.m.arr(beta, (n, nv))[:] = ops.sigmoid(self.m.arr(braw, (n, nv)))
        alpha = self.m.arr(araw, (n, nv)) + self.m.arr(dt_bias, (nv,))
        self.m.arr(g, (n, nv))[:] = self.m.arr(ssm_a, (nv,)) * ops.softplus(alpha)

    def gated_rmsnorm(self, stream, o, w, z, y, rows, dv, eps):
        from engine.ops import reference as ops

        self.m.arr(y, (rows, dv))[:] = ops.gated_rmsnorm(self.m.arr(o, (rows, dv)), self.m.arr(w, (dv,)),
                                                         self.m.arr(z, (rows, dv)), eps)

    def swiglu(self, stream, hg, act, rows, ff):
        from engine.ops import reference as ops

        h = self.m.arr(hg, (rows, 2 * ff))
        self.m.arr(act, (rows, ff))[:] = ops.silu(h[:, :ff]) * h[:, ff:]

    def router_topk(self, stream, logits, n, e, k, idx, w):
        from engine.ops import reference as ops

        i, wt = ops.topk_route(self.m.arr(logits, (n, e)), k)
        self.m.arr(idx, (n, k), np.int32)[:] = i
        self.m.arr(w, (n, k))[:] = wt

    def route(self, stream, idx, w, n, k, e, stride, counts, cursor, tiles, n_tiles, a_rows, row_w, inv):
        t = route_tables(self.m.arr(idx, (n, k), np.int32), self.m.arr(w, (n, k)), e,
                         np.arange(e, dtype=np.int64) * stride)
        self.m.arr(tiles, t.tiles.shape, np.int64)[:] = t.tiles
        self.m.arr(n_tiles, (1,), np.int32)[:] = len(t.tiles)
        self.m.arr(a_rows, (n * k,), np.int32)[:] = t.a_rows
        self.m.arr(row_w, (n * k,))[:] = t.row_w
        self.m.arr(inv, (n * k,), np.int32)[:] = t.inv
        return n * k // TILE_ROWS + min(e, n * k)

    def moe_combine(self, stream, h, outs, inv, n, k, sh, y, w_shgate, d):
        from engine.ops import reference as ops

        hh = self.m.arr(h, (n, d))
        rows = np.sort(self.m.arr(inv, (n, k), np.int32), axis=1)
        acc = np.zeros((n, d), np.float32)
        for s in range(k):
            acc += np.stack([self.m.arr(outs + int(r) * d * 4, (d,)) for r in rows[:, s]])
        if sh:
            gate = ops.sigmoid(self.m.arr(y, (n, d)) @ self.m.arr(w_shgate, (d,)))
            acc = acc + self.m.arr(sh, (n, d)) * gate[:, None]
        hh += acc

    def gdn_chunked(self, stream, u, beta, g, cw, cu, cp, cg, state, o, n, c, nk, nv, dk, dv):
        from engine.ops import reference as ops

        x = self.m.arr(u, (n, c))
        q = x[:, :nk * dk].reshape(n, nk, dk)
        k = x[:, nk * dk:2 * nk * dk].reshape(n, nk, dk)
        v = x[:, 2 * nk * dk:].reshape(n, nv, dv)
        s = self.m.arr(state, (nv, dk, dv))
        out, s[:] = ops.gdn_chunked(q, k, v, self.m.arr(g, (n, nv)), self.m.arr(beta, (n, nv)), s)
        self.m.arr(o, (n, nv, dv))[:] = out

    def flash_attention(self, stream, q, qg, kc, vc, out, n, pos0, n_head, n_kv, hd):
        from engine.ops import reference as ops

        end = pos0 + n
        gate = self.m.arr(qg, (n, n_head, 2 * hd))[..., hd:]
        self.m.arr(out, (n, n_head * hd))[:] = ops.gated_attention(
            self.m.arr(q, (n, n_head, hd)), gate, self.m.arr(kc, (end, n_kv, hd)), self.m.arr(vc, (end, n_kv, hd)))
