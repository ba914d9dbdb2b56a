"""Byte-level language-modelling data (vocabulary 256, no tokenizer files).

The default corpus is built at run time from text every Python install has: the standard library's
own ``.py`` sources, read in sorted path order and capped at ``max_bytes``, so it is deterministic for a
given Python version and nothing is copied into the repository. Any text file can be used instead.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

#: Default cap on the standard-library corpus (4 MB: ~31k windows of 128 bytes).
DEFAULT_MAX_BYTES = 4_000_000

# Directories under the stdlib path that hold third-party or generated code, not the stdlib itself;
# leaving them out keeps the corpus the same whatever else is installed.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def _stdlib_sources(stdlib_dir: Path) -> list[Path]:
    files: list[Path] = []
    for root, dirs, names in os.walk(stdlib_dir):
        dirs[:] = sorted(d for d in dirs if d not in _EXCLUDED_DIRS and not d.startswith("."))
        files.extend(Path(root) / n for n in sorted(names) if n.endswith(".py"))
    # os.walk visits in sorted order already, but sort the relative paths once more so the order
    # never depends on the walk.
    return sorted(files, key=lambda p: p.relative_to(stdlib_dir).as_posix())


def stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES, stdlib_dir: str | os.PathLike | None = None) -> bytes:
    """The standard library's ``.py`` sources concatenated in sorted path order, cut at ``max_bytes``.

    Each file is followed by a blank line. ``stdlib_dir`` defaults to ``sysconfig.get_paths()["stdlib"]``.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = Path(stdlib_dir if stdlib_dir is not None else sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in _stdlib_sources(root):
        try:
            data = path.read_bytes()
        except OSError:  # unreadable file (permissions, broken link): skip, the order stays fixed
            continue
        chunks.append(data + b"\n\n")
        total += len(data) + 2
        if total >= max_bytes:
            break
    corpus = b"".join(chunks)[:max_bytes]
    if not corpus:
        raise FileNotFoundError(f"no .py sources found under {root}; pass a text file instead")
    return corpus


def load_corpus(path: str | os.PathLike | None = None, max_bytes: int | None = DEFAULT_MAX_BYTES) -> bytes:
    """The bytes of ``path`` (any file, read as raw bytes), or the stdlib corpus when ``path`` is None.

    ``max_bytes`` caps either source (``None``: no cap for a file).
    """
    if path is None:
        return stdlib_corpus(DEFAULT_MAX_BYTES if max_bytes is None else max_bytes)
    data = Path(path).read_bytes()
    if max_bytes is not None:
        data = data[:max_bytes]
    if not data:
        raise ValueError(f"text file {path} is empty")
    return data


def encode(data: bytes | str) -> torch.Tensor:
    """Bytes (or a str, encoded as UTF-8) → a 1-D uint8 tensor of token ids in [0, 256)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def decode(tokens: torch.Tensor) -> str:
    """Token ids → text (invalid UTF-8 sequences are replaced)."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


class TextDataset(Dataset):
    """Windows of ``block_size`` tokens: item ``i`` is ``(x, y)``, int64 tensors of length
    ``block_size`` with ``y[t] == x[t + 1]`` (the next token).

    Windows start every ``stride`` tokens (default ``block_size``: non-overlapping).
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int | None = None) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.stride = block_size if stride is None else stride
        if self.stride < 1:
            raise ValueError(f"stride must be >= 1, got {self.stride}")
        if tokens.numel() < block_size + 1:
            raise ValueError(
                f"{tokens.numel()} tokens are too few for one window of block_size {block_size} "
                "(need block_size + 1); use more text or a smaller block_size"
            )
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (self.tokens.numel() - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        start = i * self.stride
        chunk = self.tokens[start : start + self.block_size + 1].to(torch.int64)
        return chunk[:-1], chunk[1:]


def train_val_split(tokens: torch.Tensor, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a token stream into a leading train part and a trailing validation part."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = max(1, int(tokens.numel() * val_fraction))
    return tokens[:-n_val], tokens[-n_val:]


def build_text_datasets(
    block_size: int,
    path: str | os.PathLike | None = None,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    val_fraction: float = 0.1,
    stride: int | None = None,
) -> tuple[TextDataset, TextDataset]:
    """``(train, val)`` datasets over ``path`` (or the stdlib corpus); the val windows never overlap."""
    train, val = train_val_split(encode(load_corpus(path, max_bytes)), val_fraction)
    return TextDataset(train, block_size, stride), TextDataset(val, block_size)
