"""The character dataset: vocabulary, encoding, train/validation split and clear errors."""

import fsspec
import pytest
import torch

from char_dataset import CharDataset, DataConfig, DatasetError


def make(text: str, block_size: int = 4, split: float = 0.9) -> CharDataset:
    return CharDataset(DataConfig(path="unused", block_size=block_size, train_split=split), text=text)


def test_encode_decode_round_trip_and_sorted_vocabulary():
    ds = make("hello world, hello again" * 3)
    assert ds.tokenizer.chars == "".join(sorted(set("hello world, hello again")))
    assert ds.tokenizer.decode(ds.tokenizer.encode("hello")) == "hello"
    assert ds.tokenizer.decode(ds.data) == "hello world, hello again" * 3


def test_windows_are_shifted_by_one_and_batch_matches_getitem():
    ds = make("abcdefghijklmnopqrstuvwxyz" * 4, block_size=5)
    x, y = ds.train[3]
    assert torch.equal(x[1:], y[:-1])
    bx, by = ds.train.batch(torch.tensor([3, 7]))
    assert torch.equal(bx[0], x) and torch.equal(by[0], y)
    assert bx.shape == (2, 5) and bx.dtype == torch.long


def test_no_validation_window_overlaps_training_text():
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    ds = make(text, block_size=8)
    n_train = int(1000 * 0.9)
    last_train_start = len(ds.train) - 1
    assert last_train_start + 8 + 1 <= n_train  # last train window (with target) ends inside the train region
    assert torch.equal(ds.val.data, ds.data[n_train:])  # validation windows only see the tail
    assert len(ds.train) + 8 == n_train and len(ds.val) + 8 == 1000 - n_train


def test_chinese_text_with_thousands_of_characters_uses_two_byte_ids():
    text = "".join(chr(0x4E00 + (i * 7919) % 3000) for i in range(20000))
    ds = make(text, block_size=16)
    assert ds.vocab_size == 3000
    assert ds.data.dtype == torch.int16
    assert ds.tokenizer.decode(ds.data[:50]) == text[:50]


def test_ascii_corpus_is_stored_one_byte_per_character(shakespeare):
    ds = CharDataset(DataConfig(path=str(shakespeare), block_size=64))
    assert ds.vocab_size == 65 and ds.data.dtype == torch.uint8 and len(ds.data) == 1_115_394


def test_reads_any_fsspec_url():
    with fsspec.open("memory://corpus/text.txt", "wb") as f:
        f.write("to be or not to be, that is the question".encode())
    ds = CharDataset(DataConfig(path="memory://corpus/text.txt", block_size=4, train_split=0.5))
    assert ds.tokenizer.decode(ds.data).startswith("to be or")


def test_missing_file_names_the_setting(tmp_path):
    with pytest.raises(DatasetError, match="data_config.path: no file at"):
        CharDataset(DataConfig(path=str(tmp_path / "nope.txt")))


def test_undecodable_bytes_are_reported_with_their_offset(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"hello caf\xe9 world" * 10)
    with pytest.raises(DatasetError, match="not UTF-8 text .*offset 9"):
        CharDataset(DataConfig(path=str(bad)))


def test_text_shorter_than_one_window_is_an_error():
    with pytest.raises(DatasetError, match="fewer than block_size \\+ 1"):
        make("short", block_size=8)


def test_validation_region_too_small_for_one_window_is_an_error():
    with pytest.raises(DatasetError, match="validation region has 10 characters"):
        make("x" * 100, block_size=16, split=0.9)


def test_unknown_prompt_characters_are_named():
    ds = make("abcabcabcabc" * 5)
    with pytest.raises(ValueError, match="'z'"):
        ds.tokenizer.encode("abz")
