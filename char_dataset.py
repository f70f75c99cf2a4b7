"""Character-level data: the prepared token file, its vocabulary, and the windows training reads.

prepare.py encodes the corpus once into a file of token ids; this module opens that
file and cuts it into windows. A training sample is the window starting at position
i: x = ids[i : i+T], y = ids[i+1 : i+T+1] (y is x shifted by one: every position
predicts the next character). A batch reads its B windows straight from the file
(TokenFile.gather), so a rank holds one batch of ids, never the corpus: its memory
does not grow with the corpus, and the OS page cache keeps one copy of the file for
all the ranks of a node.

The first `train_split` of the ids is the training region and the rest the
validation region; windows never cross the boundary, so no validation window
overlaps training text. Every position is an integer computed in integer
arithmetic: float32 cannot even count past 2^24.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from fractions import Fraction

import torch

from mingpt_ddp.config.data import DataConfig  # noqa: F401 - this dataset's config section
from mingpt_ddp.corpus.prepare import Prepared, ensure_prepared
from mingpt_ddp.errors import DatasetError

__all__ = [
    "CharDataset",
    "CharTokenizer",
    "DataConfig",
    "DatasetError",
    "TokenFile",
    "TokenWindows",
]


class CharTokenizer:
    """Maps characters to integer ids and back. The vocabulary is a string of distinct
    characters."""

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


class TokenFile:
    """A prepared token file, read by position with pread: nothing of it is held in memory.

    Why not a memory map (np.memmap, as nanoGPT does)? Reading random windows through
    one makes the kernel map the cached pages around each one into the process, so a
    rank's resident memory climbs towards the corpus size as training goes on (measured
    in benchmarks/data_scale.py). pread copies just the window's bytes, and the page
    cache under it is the same shared one.
    """

    def __init__(self, path: str, dtype: torch.dtype, num_tokens: int):
        if sys.byteorder != "little" and dtype != torch.uint8:
            raise DatasetError("prepared token files are little-endian; this machine is big-endian")
        self.path, self.dtype, self.num_tokens = path, dtype, num_tokens
        self.fd = os.open(path, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(
                self.fd, 0, 0, os.POSIX_FADV_RANDOM
            )  # windows come in random order: no readahead

    def __len__(self) -> int:
        return self.num_tokens

    def __del__(self) -> None:
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)

    def gather(self, starts: list[int], length: int) -> torch.Tensor:
        """(len(starts), length) ids: row i holds positions starts[i] .. starts[i]+length-1."""
        size = self.dtype.itemsize
        row = length * size
        buf = bytearray(row * len(starts))
        view = memoryview(buf)
        for i, start in enumerate(starts):
            if start < 0 or start + length > self.num_tokens:
                raise IndexError(
                    f"window [{start}, {start + length}) is outside the {self.num_tokens} ids"
                )
            if os.preadv(self.fd, [view[i * row : (i + 1) * row]], start * size) != row:
                raise DatasetError(
                    f"{self.path} is shorter than its meta.json says; prepare it again"
                )
        return (
            torch.frombuffer(buf, dtype=self.dtype).view(len(starts), length)
            if buf
            else torch.zeros(len(starts), length, dtype=self.dtype)
        )

    def read(self, start: int, length: int) -> torch.Tensor:
        """(length,) ids from position start."""
        return self.gather([start], length)[0]


class TokenWindows:
    """All windows of length block_size (+1 for the target) in the region [begin, end) of a token
    file."""

    def __init__(self, tokens: TokenFile, begin: int, end: int, block_size: int):
        self.tokens, self.begin, self.end, self.block_size = tokens, begin, end, block_size

    def __len__(self) -> int:
        return self.end - self.begin - self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batch(torch.tensor([i]))
        return x[0], y[0]

    def ids(self, starts: torch.Tensor) -> torch.Tensor:
        """The windows that start at `starts` (B,) with their targets: (B, T+1) ids in the file's
        compact dtype."""
        if len(starts) and (int(starts.min()) < 0 or int(starts.max()) >= len(self)):
            raise IndexError(f"window starts must be in [0, {len(self)})")
        return self.tokens.gather([self.begin + s for s in starts.tolist()], self.block_size + 1)

    def batch(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The windows that start at `starts` (B,), as x, y of shape (B, T), int64 (y is x shifted
        by one)."""
        chunk = self.ids(starts).long()  # (B, T+1)
        return chunk[:, :-1], chunk[:, 1:]

    def evenly_spaced(self, count: int) -> torch.Tensor:
        """`count` window starts from the first window to the last, evenly spaced, in integer
        arithmetic: (count,) int64. (A float32 linspace rounds starts above 2^24 past the end.)"""
        if count == 1:
            return torch.zeros(1, dtype=torch.int64)
        return torch.arange(count, dtype=torch.int64) * (len(self) - 1) // (count - 1)


def split_point(num_tokens: int, train_split: float) -> int:
    """How many ids the training region gets: floor(num_tokens * train_split), computed exactly
    (train_split read as the decimal the user wrote, e.g. 0.9 = 9/10, not its binary
    approximation)."""
    fraction = Fraction(str(train_split))
    return num_tokens * fraction.numerator // fraction.denominator


class CharDataset:
    """A prepared corpus: its tokenizer and its train/validation windows."""

    def __init__(
        self, cfg: DataConfig, s3_endpoint_url: str = "", log: Callable[[str], None] = print
    ):
        self.config = cfg
        self.prepared: Prepared = ensure_prepared(cfg.path, cfg.cache_dir, s3_endpoint_url, log)
        meta = self.prepared.meta
        self.tokenizer = CharTokenizer(meta["vocab"])
        self.tokens = TokenFile(self.prepared.tokens_path, self.prepared.dtype, meta["num_tokens"])
        T, n = cfg.block_size, meta["num_tokens"]
        if n < T + 1:
            raise DatasetError(
                f"data_config.path: the text has {n} characters, fewer than "
                f"block_size + 1 = {T + 1}; use a longer text or a smaller data_config.block_size"
            )
        n_train = split_point(n, cfg.train_split)
        if n_train < T + 1:
            raise DatasetError(
                f"data_config.train_split: the training region has {n_train} characters, "
                f"fewer than block_size + 1 = {T + 1}; raise data_config.train_split or lower "
                "data_config.block_size"
            )
        if n - n_train < T + 1:
            raise DatasetError(
                f"data_config.train_split: the validation region has {n - n_train} characters, "
                f"fewer than block_size + 1 = {T + 1}; lower data_config.train_split or "
                "data_config.block_size"
            )
        self.train = TokenWindows(self.tokens, 0, n_train, T)
        self.val = TokenWindows(self.tokens, n_train, n, T)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def to_device(device: torch.device, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T+1) ids from the token file -> inputs x and targets y, (B, T) int64 on the device.
    A GPU gets the compact ids (1-2 bytes each) from pinned memory: an asynchronous DMA."""
    if device.type == "cuda":
        ids = ids.pin_memory().to(device, non_blocking=True)
    ids = ids.long()  # (B, T+1)
    return ids[:, :-1], ids[:, 1:]
