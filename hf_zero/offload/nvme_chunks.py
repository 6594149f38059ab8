"""The offloaded optimizer's NVMe tier: each chunk's fp32 master and state in a swap file.

A chunk's record is its master section followed by one section per state key, each rounded up
to the I/O alignment. :meth:`_NvmeChunks._step_nvme` reads chunk *i+1* into a pool buffer while
chunk *i* is stepped, and writes chunk *i* back behind it; :meth:`_NvmeChunks.prefetch` starts
reading the first chunks while the backward that precedes the step runs. File I/O itself is
``nvme.py``. A mixin of :class:`hf_zero.offload.host_optimizer.OffloadedOptimizer` (its attributes).
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any

import torch

from hf_zero.offload.base import OffloadError
from hf_zero.offload.host_layout import _SETTING, _Chunk, _wait_futures

__all__: list[str] = []


class _NvmeChunks:
    """Swap-file layout, reads, read-ahead and write-behind of the offloaded optimizer's chunks."""

    def _section_bytes(self, chunk: _Chunk) -> int:
        from hf_zero.offload.nvme import round_up

        return round_up(chunk.numel * 4)

    def _record_bytes(self, chunk: _Chunk) -> int:
        return self._section_bytes(chunk) * (1 + len(self._state_keys))

    def _setup_nvme(self) -> None:
        from hf_zero.offload.nvme import BufferPool, SwapDir, SwapSpace

        if not self.cfg.nvme_path:
            raise OffloadError(f"{_SETTING}.device=nvme needs {_SETTING}.nvme_path")
        if self._swap_dir_factory is not None:
            swap_dir, owns = self._swap_dir_factory(), False
        else:
            from hf_zero.offload.nvme import new_run_id

            swap_dir = SwapDir(self.cfg.nvme_path, self.cfg.run_id or new_run_id(), self._rank, f"{_SETTING}.nvme_path")
            owns = True
        self._space = SwapSpace(swap_dir, self.cfg.aio, f"{_SETTING}.nvme_path", owns_dir=owns)
        needed = sum(self._record_bytes(c) for c in self.chunks)
        self._space.check_free_space(needed)
        for chunk in self.chunks:
            self._space.create(f"optimizer_chunk{chunk.index:05d}.swp", self._record_bytes(chunk))
        largest = max((self._record_bytes(c) for c in self.chunks), default=4096)
        # Each buffer holds one chunk's record (master + state) at a time, and a step never puts two
        # buffers on one chunk: buffers beyond one per chunk would never be used.
        count = max(1, min(int(self.cfg.buffer_count), len(self.chunks)))
        self._pool = BufferPool(count, largest, pin=self._pin, setting=f"{_SETTING}.pin_memory")
        # Write the initial masters; from here on the host keeps none.
        for chunk in self.chunks:
            buf = self._pool.acquire()
            try:
                master = self._section(buf, chunk, 0)
                for piece in chunk.pieces:
                    master[piece.offset : piece.offset + piece.numel].copy_(piece.slot.master[piece.start : piece.end])
                self._space.write(self._record(chunk), buf, self._section_bytes(chunk)).wait()
            finally:
                self._pool.release(buf)
        for slot in self.slots:
            slot.master = None

    def _record(self, chunk: _Chunk) -> str:
        return f"optimizer_chunk{chunk.index:05d}.swp"

    def _section(self, buf: torch.Tensor, chunk: _Chunk, k: int) -> torch.Tensor:
        """Section ``k`` of a chunk's buffer as fp32: 0 is the master, 1.. the state keys."""
        size = self._section_bytes(chunk)
        return buf[k * size : k * size + chunk.numel * 4].view(torch.float32)

    def _start_read(self, chunk: _Chunk) -> tuple[torch.Tensor, Any]:
        buf = self._pool.acquire()
        try:
            length = self._record_bytes(chunk) if chunk.written else self._section_bytes(chunk)
            return buf, self._space.read(self._record(chunk), buf, length)
        except BaseException:
            self._pool.release(buf)
            raise

    def prefetch(self) -> None:
        """Start reading the first chunks into free buffers (called when backward begins), so
        that the step finds them in memory. Keeps one buffer free for the step's own read-ahead,
        unless there is a buffer for every chunk (then every chunk is read now)."""
        if not self._nvme or self._closed or self._prefetched:
            return
        keep_free = 0 if self._pool.count >= len(self.chunks) else 1
        for chunk in self.chunks[: self._pool.count - keep_free]:
            if self._pool.available() <= keep_free:
                break
            self._prefetched[chunk.index] = self._start_read(chunk)

    def _step_nvme(self) -> None:
        active = [c for c in self.chunks if any(not p.slot.fresh for p in c.pieces)]
        reads = self._prefetched
        self._prefetched = {}
        writes = []
        copies = []
        try:
            for i, chunk in enumerate(active):
                buf, handle = reads.pop(chunk.index, None) or self._start_read(chunk)
                try:
                    handle.wait()
                    nxt = active[i + 1] if i + 1 < len(active) else None
                    if nxt is not None and nxt.index not in reads and self._pool.count >= 2:
                        reads[nxt.index] = self._start_read(nxt)  # read ahead while this one steps
                    self._bind_buffer(chunk, buf)
                    self._bind_grads(chunk)
                    chunk.optimizer.step()
                    self._capture_state(chunk, buf)
                except BaseException:
                    self._pool.release(buf)
                    raise
                chunk.written = True
                master = self._section(buf, chunk, 0)
                copy = self._copier.submit(
                    self._copy_back, chunk, lambda p, m=master: m[p.offset : p.offset + p.numel]
                )
                write = self._space.write(self._record(chunk), buf, self._record_bytes(chunk))
                _release_after(self._pool, buf, copy, write)
                copies.append(copy)
                writes.append(write)
                self._unbind(chunk)
        finally:
            # Reads started for chunks that no longer step (an error above): drain, free buffers.
            for buf, handle in reads.values():
                try:
                    handle.wait()
                except OffloadError:
                    pass
                self._pool.release(buf)
            from hf_zero.offload.nvme import wait_all

            try:
                _wait_futures(copies)
            finally:
                wait_all(writes)

    def _bind_buffer(self, chunk: _Chunk, buf: torch.Tensor) -> None:
        master = self._section(buf, chunk, 0)
        sections = {key: self._section(buf, chunk, k + 1) for k, key in enumerate(self._state_keys)}
        state = chunk.optimizer.state
        for piece in chunk.pieces:
            piece.tensor.data = master[piece.offset : piece.offset + piece.numel]
            if piece.adopted:
                # (an optimizer without scalar state, like SGD, has an empty dict here)
                st = state.setdefault(piece.tensor, {})
                for key, section in sections.items():
                    st[key] = section[piece.offset : piece.offset + piece.numel]

    def _capture_state(self, chunk: _Chunk, buf: torch.Tensor) -> None:
        """After a step: state the inner optimizer created lazily goes into the buffer's sections."""
        state = chunk.optimizer.state
        for k, key in enumerate(self._state_keys):
            section = self._section(buf, chunk, k + 1)
            for piece in chunk.pieces:
                st = state.get(piece.tensor)
                if not st or piece.adopted:
                    continue
                value = st.get(key)
                if torch.is_tensor(value) and value.shape == piece.tensor.shape:
                    section[piece.offset : piece.offset + piece.numel].copy_(value)
        for piece in chunk.pieces:
            if state.get(piece.tensor):
                piece.adopted = True

    def _unbind(self, chunk: _Chunk) -> None:
        """Drop references into the buffer (it goes back to the pool once written)."""
        state = chunk.optimizer.state
        for piece in chunk.pieces:
            piece.tensor.data = torch.empty(0)
            piece.tensor.grad = None
            st = state.get(piece.tensor)
            if st:
                for key in self._state_keys:
                    st.pop(key, None)

    def _read_all_into(self, out: dict) -> None:
        for chunk in self.chunks:
            buf, handle = self._start_read(chunk)
            try:
                handle.wait()
                master = self._section(buf, chunk, 0)
                for piece in chunk.pieces:
                    m, per_key, _ = out[id(piece.slot)]
                    m[piece.start : piece.end].copy_(master[piece.offset : piece.offset + piece.numel])
                    if chunk.written and piece.adopted:
                        for k, key in enumerate(self._state_keys):
                            section = self._section(buf, chunk, k + 1)
                            per_key[key][piece.start : piece.end].copy_(section[piece.offset : piece.offset + piece.numel])
            finally:
                self._pool.release(buf)

    def _write_all_from(self, loaded: dict) -> None:
        for chunk in self.chunks:
            buf = self._pool.acquire()
            try:
                master = self._section(buf, chunk, 0)
                any_state = False
                for piece in chunk.pieces:
                    m, per_key, _, _ = loaded[id(piece.slot)]
                    master[piece.offset : piece.offset + piece.numel].copy_(m[piece.start : piece.end])
                    for k, key in enumerate(self._state_keys):
                        section = self._section(buf, chunk, k + 1)
                        value = per_key.get(key)
                        target = section[piece.offset : piece.offset + piece.numel]
                        if value is not None:
                            target.copy_(value[piece.start : piece.end])
                            any_state = True
                        else:
                            target.zero_()
                self._space.write(self._record(chunk), buf, self._record_bytes(chunk)).wait()
                chunk.written = any_state or chunk.written
            finally:
                self._pool.release(buf)

    def _flush_prefetch(self) -> None:
        prefetched, self._prefetched = self._prefetched, {}
        for buf, handle in prefetched.values():
            try:
                handle.wait()
            finally:
                self._pool.release(buf)


def _release_after(pool: Any, buf: torch.Tensor, copy: cf.Future, write: Any) -> None:
    """Give ``buf`` back to the pool once the copy-back and the write have both read it."""
    remaining = [2]
    import threading

    lock = threading.Lock()

    def done(*_args: Any) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            pool.release(buf)

    copy.add_done_callback(done)
    write.add_done_callback(done)
