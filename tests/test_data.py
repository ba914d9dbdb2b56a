import pytest
import torch

from shardspeed.data import (
    TextDataset,
    build_text_datasets,
    decode,
    encode,
    load_corpus,
    stdlib_corpus,
    train_val_split,
)


def test_stdlib_corpus_is_deterministic_and_capped():
    a = stdlib_corpus(max_bytes=200_000)
    b = stdlib_corpus(max_bytes=200_000)
    assert a == b
    assert len(a) == 200_000  # every Python install has more stdlib source than this
    assert b"def " in a and b"import " in a


def test_smaller_cap_is_a_prefix():
    assert stdlib_corpus(max_bytes=50_000) == stdlib_corpus(max_bytes=200_000)[:50_000]


def test_load_corpus_reads_a_user_file(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("héllo wörld\n" * 10, encoding="utf-8")
    assert load_corpus(f) == f.read_bytes()
    assert load_corpus(f, max_bytes=5) == f.read_bytes()[:5]
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(tmp_path / "empty.txt")


def test_encode_decode_roundtrip():
    text = "byte-level: ünïcode ✓\n"
    tokens = encode(text)
    assert tokens.dtype == torch.uint8 and tokens.numel() == len(text.encode())
    assert decode(tokens) == text


def test_windows_shift_by_one():
    tokens = torch.arange(100, dtype=torch.uint8)
    ds = TextDataset(tokens, block_size=8)
    assert len(ds) == (100 - 9) // 8 + 1
    for i in (0, 1, len(ds) - 1):
        x, y = ds[i]
        assert x.dtype == torch.int64 and y.dtype == torch.int64
        assert x.shape == y.shape == (8,)
        assert torch.equal(y[:-1], x[1:])
        assert x[0].item() == 8 * i
        assert y[-1].item() == 8 * i + 8
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_strided_windows():
    ds = TextDataset(torch.arange(50, dtype=torch.uint8), block_size=10, stride=3)
    assert len(ds) == (50 - 11) // 3 + 1
    assert ds[2][0][0].item() == 6
    last_x, last_y = ds[len(ds) - 1]
    assert last_y[-1].item() <= 49


def test_too_little_text_is_an_error():
    with pytest.raises(ValueError, match="too few"):
        TextDataset(torch.zeros(8, dtype=torch.uint8), block_size=8)


def test_train_val_split():
    tokens = torch.arange(100, dtype=torch.uint8)
    train, val = train_val_split(tokens, 0.1)
    assert train.numel() == 90 and val.numel() == 10
    assert torch.equal(torch.cat([train, val]), tokens)


def test_build_text_datasets_from_stdlib():
    train, val = build_text_datasets(block_size=32, max_bytes=100_000)
    assert len(train) > 0 and len(val) > 0
    x, y = train[0]
    assert x.max() < 256 and torch.equal(y[:-1], x[1:])
