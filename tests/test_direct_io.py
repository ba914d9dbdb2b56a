"""O_DIRECT file I/O (shardspeed/utils/direct_io.py): the stream writer of checkpoint files and the aligned
buffers, with O_DIRECT and with the buffered fallback a file system without it gets; both must give the
same bytes."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from safetensors import safe_open

from shardspeed.checkpoint import format as fmt
from shardspeed.utils import direct_io
from shardspeed.utils.direct_io import ALIGN, StreamWriter, aligned_empty, direct_ok


@pytest.fixture(params=["direct", "buffered"])
def mode(request, monkeypatch):
    if request.param == "buffered":  # what tmpfs or macOS gets
        monkeypatch.setattr(direct_io, "open_direct", lambda *a, **k: None)
    return request.param


def _pieces(seed: int):
    g = np.random.default_rng(seed)
    sizes = [0, 1, 7, ALIGN - 3, ALIGN, 3 * ALIGN + 5, (direct_io.STREAM_CHUNK * 2) + 11, 100]
    return [g.integers(0, 256, n, dtype=np.uint8) for n in sizes]


def test_stream_writer_writes_any_pieces_exactly(tmp_path, mode):
    path = str(tmp_path / "f.bin")
    pieces = _pieces(0)
    w = StreamWriter(path)
    assert w.direct == (mode == "direct"), "tmp_path's file system should take O_DIRECT"
    seen = []
    for i, p in enumerate(pieces):
        w.write(p, lambda piece: seen.append(bytes(piece)))  # (a view of the bounce buffer: copy it now)
        if i == 3:
            w.flush()  # a crash test's partial file: exactly the bytes so far
            assert os.path.getsize(path) == sum(x.size for x in pieces[:4])
    w.close()
    want = b"".join(p.tobytes() for p in pieces)
    with open(path, "rb") as f:
        assert f.read() == want
    assert b"".join(bytes(s) for s in seen) == want, "the digest sees every byte once, in order"
    assert w.written == len(want)


def test_safetensors_files_are_the_same_with_and_without_o_direct(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    items = [("a", torch.randn(3, 1001, generator=g)), ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
             ("c", torch.randint(0, 9, (5_000_001,), generator=g)), ("d", torch.zeros(0))]
    direct = fmt.write_safetensors(str(tmp_path / "d.safetensors"), items, {"k": "v"})
    monkeypatch.setattr(direct_io, "open_direct", lambda *a, **k: None)
    buffered = fmt.write_safetensors(str(tmp_path / "b.safetensors"), items, {"k": "v"})
    with open(tmp_path / "d.safetensors", "rb") as f1, open(tmp_path / "b.safetensors", "rb") as f2:
        assert f1.read() == f2.read()
    assert direct == buffered
    with safe_open(str(tmp_path / "d.safetensors"), framework="pt") as f:
        for k, t in items:
            assert torch.equal(f.get_tensor(k), t)


def test_aligned_buffers_and_the_alignment_rule():
    b = aligned_empty(3 * ALIGN + 1)
    assert b.numel() == 3 * ALIGN + 1 and b.data_ptr() % ALIGN == 0
    assert direct_ok(b[:ALIGN], 0) and direct_ok(b[ALIGN:], ALIGN) is False  # length not a multiple
    assert not direct_ok(b[1 : ALIGN + 1], 0), "address off by one"
    assert not direct_ok(b[:ALIGN], 512), "file offset not aligned"
    assert not direct_ok(b[:0], 0), "nothing to move"


def _refuse_direct(monkeypatch, module, name: str, fds: set):
    """``module.os.<name>`` raising EINVAL on the descriptors in ``fds`` (a file system that takes O_DIRECT at
    open and refuses the transfers)."""
    real = getattr(os, name)

    def refusing(fd, *args):
        if fd in fds:
            raise OSError(22, "Invalid argument")
        return real(fd, *args)

    monkeypatch.setattr(module.os, name, refusing)


def test_refused_direct_transfers_fall_back_to_buffered(tmp_path, monkeypatch):
    from shardspeed.offload import swap_io

    pieces = _pieces(1)
    w = StreamWriter(str(tmp_path / "f.bin"))
    assert w.direct
    _refuse_direct(monkeypatch, direct_io, "pwrite", {w.fd})
    for p in pieces:
        w.write(p)
    w.close()
    assert not w.direct
    with open(tmp_path / "f.bin", "rb") as f:
        assert f.read() == b"".join(p.tobytes() for p in pieces)
    monkeypatch.undo()

    f = swap_io.SwapFile(str(tmp_path / "swap"))
    assert f.direct_fd is not None
    _refuse_direct(monkeypatch, swap_io, "pwritev", {f.direct_fd})
    _refuse_direct(monkeypatch, swap_io, "preadv", {f.direct_fd})
    data = aligned_empty(3 * (4 << 20))
    data.copy_(torch.randint(0, 256, (data.numel(),), dtype=torch.uint8))
    sums = f.write(data, 0, checksum=True)
    back = aligned_empty(data.numel())
    assert torch.equal(f.read(back, 0, checksum=True), sums) and torch.equal(back, data)
    assert f.direct_fd is None
    f.close()
