"""The character vocabulary as a tokenizer that transformers' AutoTokenizer loads, and back.

One token per character: a word-level model whose words are the characters (id i = the i-th
character of the vocabulary, as CharTokenizer numbers them), a pre-tokenizer that splits the text
into single characters (a whitespace pre-tokenizer would drop the spaces and newlines, which are
characters of the vocabulary), and the Fuse decoder, which joins the tokens back exactly. No
special tokens are added: the end of text is the newline (or the first character), as a
character-level model has no other.
"""

from __future__ import annotations

import json
import os

from mingpt_ddp.errors import ConfigError


def end_of_text(chars: str) -> str:
    """The character used as BOS and EOS: the newline where the vocabulary has it."""
    return "\n" if "\n" in chars else chars[0]


def tokenizer_for(chars: str, block_size: int):
    """A transformers tokenizer (save_pretrained writes tokenizer.json and its config)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({ch: i for i, ch in enumerate(chars)}, unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # "".join(tokens): spaces and newlines as they were
    eos = end_of_text(chars)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=eos,
        eos_token=eos,
        clean_up_tokenization_spaces=False,  # its default would drop the space before "," or "!"
        model_max_length=block_size,
    )


def chars_of(folder: str) -> str:
    """The character vocabulary of a folder's tokenizer.json, in id order; refused unless every
    token is one character and the ids run 0..V-1."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise ConfigError(
            f"{folder} has no tokenizer.json: a character vocabulary is needed to train on "
            "characters (python -m mingpt_ddp.export writes one)"
        )
    with open(path, encoding="utf-8") as f:
        vocab = json.load(f)["model"].get("vocab", {})
    by_id = sorted(vocab.items(), key=lambda item: item[1])
    if not vocab or [i for _, i in by_id] != list(range(len(by_id))):
        raise ConfigError(f"{path}: not a word-level vocabulary with ids 0..V-1")
    if long := [token for token, _ in by_id if len(token) != 1]:
        raise ConfigError(
            f"{path}: tokens of several characters ({long[:3]}...): this project trains on "
            "characters, one token each"
        )
    return "".join(token for token, _ in by_id)
