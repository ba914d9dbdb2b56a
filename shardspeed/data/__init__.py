"""Datasets for the examples and tests: byte-level text built at run time, nothing bundled."""

from shardspeed.data.text import (
    DEFAULT_MAX_BYTES,
    TextDataset,
    build_text_datasets,
    decode,
    encode,
    load_corpus,
    stdlib_corpus,
    train_val_split,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "TextDataset",
    "build_text_datasets",
    "decode",
    "encode",
    "load_corpus",
    "stdlib_corpus",
    "train_val_split",
]
