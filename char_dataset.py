"""Character-level data: read a UTF-8 corpus, build its vocabulary, cut it into windows.

The whole corpus is encoded once into one compact integer tensor. A training
sample is the window starting at position i: x = data[i : i+T], y = data[i+1 : i+T+1]
(y is x shifted by one: every position predicts the next character). Batches are
gathered straight from that tensor with one indexing op, so the hot loop does no
per-sample Python work.

The first `train_split` of the text is the training region and the rest the
validation region; windows never cross the boundary, so no validation window
overlaps training text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import fsspec
import torch
from torch.utils.data import Dataset

from config import ConfigError


class DatasetError(ValueError):
    """The corpus cannot be used as configured; the message says what to change."""


@dataclass
class DataConfig:
    """Where the text is and how it is cut (YAML section `data_config`)."""

    section: ClassVar[str] = "data_config"

    path: str = "data/tinyshakespeare/input.txt"
    """UTF-8 text: a local path (relative to where you launch) or any fsspec URL."""
    block_size: int = 64
    """Context length T: characters the model sees at once."""
    train_split: float = 0.9
    """Fraction of the text (from the start) used for training; the rest is validation."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("data_config.path must name a UTF-8 text file")
        if self.block_size <= 0:
            raise ConfigError(f"data_config.block_size must be positive, got {self.block_size}")
        if not 0.0 < self.train_split < 1.0:
            raise ConfigError(f"data_config.train_split must be in (0, 1), got {self.train_split}")


class CharTokenizer:
    """Maps characters to integer ids and back. The vocabulary is a string of distinct characters."""

    def __init__(self, chars: str):
        self.chars = chars
        self.stoi = {ch: i for i, ch in enumerate(chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        unknown = sorted(set(text) - self.stoi.keys())
        if unknown:
            raise ValueError(f"characters not in the vocabulary: {''.join(unknown)!r}")
        return torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.chars[i] for i in ids)


class TokenWindows(Dataset):
    """All windows of length block_size (+1 for the target) in one region of the encoded text."""

    def __init__(self, data: torch.Tensor, block_size: int):
        self.data = data  # (N,) compact integer ids
        self.block_size = block_size
        self.offsets = torch.arange(block_size + 1)  # (T+1,)

    def __len__(self) -> int:
        return len(self.data) - self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i : i + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]

    def batch(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather the windows that start at `starts` (B,) in one op: returns x, y of shape (B, T)."""
        chunk = self.data[starts[:, None] + self.offsets].long()  # (B, 1) + (T+1,) -> (B, T+1)
        return chunk[:, :-1], chunk[:, 1:]


def read_text(path: str) -> str:
    """Read a whole UTF-8 file from a local path or fsspec URL, with one-line errors."""
    try:
        with fsspec.open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise DatasetError(
            f"data_config.path: no file at {path!r}; set data_config.path=<your UTF-8 text> "
            "or fetch tiny Shakespeare with: python data/fetch_shakespeare.py"
        ) from None
    except (OSError, ValueError, ImportError) as e:
        raise DatasetError(f"data_config.path: cannot read {path!r}: {e}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(
            f"data_config.path: {path!r} is not UTF-8 text (undecodable byte at offset {e.start}); "
            "convert it to UTF-8 first"
        ) from None


class CharDataset:
    """A corpus encoded to ids, with its tokenizer and its train/validation windows."""

    def __init__(self, cfg: DataConfig, text: str | None = None):
        self.config = cfg
        text = read_text(cfg.path) if text is None else text
        T = cfg.block_size
        if len(text) < T + 1:
            raise DatasetError(
                f"data_config.path: the text has {len(text)} characters, fewer than block_size + 1 = {T + 1}; "
                "use a longer text or a smaller data_config.block_size"
            )
        # Vocabulary and encoding in two tensor ops instead of a Python loop per
        # character: UTF-32 gives one int per code point, and torch.unique returns
        # the sorted distinct code points plus each character's index among them.
        codepoints = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32)
        vocab, ids = torch.unique(codepoints, sorted=True, return_inverse=True)
        self.tokenizer = CharTokenizer("".join(map(chr, vocab.tolist())))
        # Store ids in the smallest dtype that fits: 1 byte per character for
        # ASCII-like corpora, 2 bytes for Chinese texts with thousands of characters.
        dtype = torch.uint8 if len(vocab) <= 256 else torch.int16 if len(vocab) <= 32767 else torch.int32
        self.data = ids.to(dtype)  # (N,)

        n_train = int(len(self.data) * cfg.train_split)
        if n_train < T + 1:
            raise DatasetError(
                f"data_config.train_split: the training region has {n_train} characters, fewer than "
                f"block_size + 1 = {T + 1}; raise data_config.train_split or lower data_config.block_size"
            )
        if len(self.data) - n_train < T + 1:
            raise DatasetError(
                f"data_config.train_split: the validation region has {len(self.data) - n_train} characters, "
                f"fewer than block_size + 1 = {T + 1}; lower data_config.train_split or data_config.block_size"
            )
        self.train = TokenWindows(self.data[:n_train], T)
        self.val = TokenWindows(self.data[n_train:], T)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size
