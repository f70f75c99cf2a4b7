"""Characters to token ids: the vocabulary (pass 1 over the corpus), the smallest integer type
that holds its ids, and the Encoder that turns text into ids in bulk (pass 2)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from mingpt_ddp.corpus.sources import SourceFile, chunks, decode

DTYPES = {"uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32}
_UNICODE = 0x110000  # code points


def _code_points(text: str) -> torch.Tensor:
    """(len(text),) int32 code points; a view of the UTF-32 bytes (read-only, never written)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "buffer is not writable": we only read it
        return (
            torch.frombuffer(text.encode("utf-32-le"), dtype=torch.int32)
            if text
            else torch.zeros(0, dtype=torch.int32)
        )


def vocabulary(files: list[SourceFile]) -> tuple[str, int]:
    """Pass 1: every distinct character of the files, sorted by code point, and how many
    characters there are."""
    present = torch.zeros(_UNICODE, dtype=torch.bool)
    known_ascii, n_chars = b"", 0
    for source in files:
        for offset, chunk in chunks(source):
            n_chars += len(decode(source, offset, chunk))  # also proves the chunk is UTF-8
            # Deleting the ASCII characters already seen (fast, bytes.translate) leaves valid
            # UTF-8 (no multi-byte character contains an ASCII byte): only what is left needs a
            # closer look.
            rest = chunk.translate(None, known_ascii)
            if rest:
                present |= torch.bincount(
                    _code_points(rest.decode("utf-8")), minlength=_UNICODE
                ).bool()
                known_ascii = bytes(present[:128].nonzero().flatten().tolist())
    return "".join(map(chr, present.nonzero().flatten().tolist())), n_chars


def smallest_dtype(vocab_size: int) -> str:
    return "uint8" if vocab_size <= 256 else "int16" if vocab_size <= 32767 else "int32"


class Encoder:
    """Characters to ids in bulk: a table indexed by code point (and a byte table for ASCII
    text)."""

    def __init__(self, vocab: str):
        self.dtype = DTYPES[smallest_dtype(len(vocab))]
        self.table = torch.zeros(_UNICODE, dtype=self.dtype)
        self.table[_code_points(vocab).long()] = torch.arange(len(vocab)).to(self.dtype)
        # ASCII text with a <= 256-character vocabulary: bytes.translate maps every byte to its
        # id directly.
        self.ascii = bytes(self.table[:256].tolist()) if self.dtype == torch.uint8 else None

    def encode(self, text_bytes: bytes, text: Callable[[], str]) -> bytearray | bytes:
        """The ids of one chunk, as raw bytes in the token dtype (text() decodes the chunk if
        needed)."""
        if self.ascii is not None and text_bytes.isascii():
            return text_bytes.translate(self.ascii)
        cps = _code_points(text())
        out = bytearray(cps.numel() * self.dtype.itemsize)
        if out:
            torch.index_select(self.table, 0, cps, out=torch.frombuffer(out, dtype=self.dtype))
        return out
