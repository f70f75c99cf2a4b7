"""The character dataset over a prepared token file: vocabulary, windows, split, evaluation starts,
errors."""

import fsspec
import pytest
import torch

from char_dataset import CharDataset, DataConfig, DatasetError, TokenWindows, split_point
from mingpt_ddp.corpus import sources


def make(
    tmp_path, text: str, block_size: int = 4, split: float = 0.9, name: str = "corpus.txt"
) -> CharDataset:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return CharDataset(
        DataConfig(
            path=str(path),
            block_size=block_size,
            train_split=split,
            cache_dir=str(tmp_path / "prepared"),
        ),
        log=lambda line: None,
    )


def all_ids(ds: CharDataset) -> torch.Tensor:
    return ds.tokens.read(0, ds.num_tokens)


def test_encode_decode_round_trip_and_sorted_vocabulary(tmp_path):
    ds = make(tmp_path, "hello world, hello again" * 3)
    assert ds.tokenizer.chars == "".join(sorted(set("hello world, hello again")))
    assert ds.tokenizer.decode(ds.tokenizer.encode("hello")) == "hello"
    assert ds.tokenizer.decode(all_ids(ds)) == "hello world, hello again" * 3


def test_windows_are_shifted_by_one_and_batch_matches_getitem(tmp_path):
    ds = make(tmp_path, "abcdefghijklmnopqrstuvwxyz" * 4, block_size=5)
    x, y = ds.train[3]
    assert ds.tokenizer.decode(x) == "defgh" and ds.tokenizer.decode(y) == "efghi"
    bx, by = ds.train.batch(torch.tensor([3, 7]))
    assert torch.equal(bx[0], x) and torch.equal(by[0], y)
    assert bx.shape == (2, 5) and bx.dtype == torch.long


def test_no_validation_window_overlaps_training_text(tmp_path):
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    T, ds = 8, make(tmp_path, text, block_size=8)
    n_train = 900
    # Every window with its target: the training ones end inside the first 900 characters,
    # the validation ones start at or after character 900.
    train_x, train_y = ds.train.batch(torch.arange(len(ds.train)))
    val_x, val_y = ds.val.batch(torch.arange(len(ds.val)))
    assert (
        ds.tokenizer.decode(train_y[-1]) == text[n_train - T : n_train]
    )  # the last training target ends at 900
    assert (
        ds.tokenizer.decode(val_x[0]) == text[n_train : n_train + T]
    )  # the first validation input starts at 900
    assert (
        len(ds.train) == n_train - T and len(ds.val) == 1000 - n_train - T
    )  # no window crosses the boundary
    with pytest.raises(IndexError):
        ds.train.batch(torch.tensor([len(ds.train)]))  # one more would read validation text
    assert torch.equal(torch.cat([train_x[:, 0], train_y[-1]]), all_ids(ds)[:n_train].long())
    assert torch.equal(torch.cat([val_x[:, 0], val_y[-1]]), all_ids(ds)[n_train:].long())


def test_the_split_point_is_exact_integer_arithmetic():
    assert split_point(10, 0.9) == 9 and split_point(1_115_394, 0.9) == 1_003_854
    n = 2**60 + 7  # where float64 would already round
    assert split_point(n, 0.9) == n * 9 // 10 and split_point(n, 0.5) == n // 2


def test_evaluation_starts_are_exact_above_2_to_the_24():
    class Region:  # only the length matters for where evaluation windows start
        def __len__(self):
            return 2**24 + 20_077_092

    starts = TokenWindows.evenly_spaced(Region(), 20 * 8 * 4)
    assert starts.dtype == torch.int64 and starts[0] == 0 and starts[-1] == len(Region()) - 1
    assert bool((starts[1:] > starts[:-1]).all())
    assert TokenWindows.evenly_spaced(Region(), 1).tolist() == [0]


def test_chinese_text_with_thousands_of_characters_uses_two_byte_ids(tmp_path):
    text = "".join(chr(0x4E00 + (i * 7919) % 3000) for i in range(20000))
    ds = make(tmp_path, text, block_size=16)
    assert ds.vocab_size == 3000 and ds.prepared.meta["dtype"] == "int16"
    assert (tmp_path / "prepared").exists() and ds.tokens.dtype == torch.int16
    assert ds.tokenizer.decode(all_ids(ds)) == text


def test_a_vocabulary_beyond_32767_characters_uses_four_byte_ids(tmp_path):
    text = "".join(chr(0x4E00 + i) for i in range(20000)) + "".join(
        chr(0x20000 + i) for i in range(13000)
    )
    ds = make(tmp_path, text * 2, block_size=16)
    assert ds.vocab_size == 33000 and ds.prepared.meta["dtype"] == "int32"
    assert ds.tokenizer.decode(all_ids(ds)) == text * 2


def test_characters_split_between_two_reads_are_decoded_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(
        sources, "CHUNK_BYTES", 7
    )  # every read cuts through some 2-, 3- or 4-byte character
    text = "añb€c😀d" * 50 + "plain ascii tail " * 5
    ds = make(tmp_path, text, block_size=4)
    assert ds.tokenizer.decode(all_ids(ds)) == text


def test_ascii_corpus_is_stored_one_byte_per_character(shakespeare, tmp_path):
    ds = CharDataset(
        DataConfig(path=str(shakespeare), block_size=64, cache_dir=str(tmp_path)),
        log=lambda _: None,
    )
    assert (
        ds.vocab_size == 65 and ds.prepared.meta["dtype"] == "uint8" and ds.num_tokens == 1_115_394
    )
    assert (
        tmp_path / ds.prepared.directory.split("/")[-1] / ds.prepared.meta["tokens_file"]
    ).stat().st_size == 1_115_394
    assert ds.tokenizer.decode(all_ids(ds)) == shakespeare.read_text()


def test_reads_any_fsspec_url(tmp_path):
    with fsspec.open("memory://corpus/text.txt", "wb") as f:
        f.write(b"to be or not to be, that is the question")
    ds = CharDataset(
        DataConfig(
            path="memory://corpus/text.txt", block_size=4, train_split=0.5, cache_dir=str(tmp_path)
        ),
        log=lambda _: None,
    )
    assert ds.tokenizer.decode(all_ids(ds)).startswith("to be or")


def test_missing_file_names_the_setting(tmp_path):
    with pytest.raises(DatasetError, match="data_config.path: no file at"):
        CharDataset(DataConfig(path=str(tmp_path / "nope.txt"), cache_dir=str(tmp_path)))


def test_undecodable_bytes_are_reported_with_their_offset(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"hello caf\xe9 world" * 10)
    with pytest.raises(DatasetError, match="not UTF-8 text .*offset 9"):
        CharDataset(DataConfig(path=str(bad), cache_dir=str(tmp_path / "prepared")))
    assert not list(
        (tmp_path / "prepared").rglob("meta.json")
    )  # nothing half-prepared is left to train on


def test_text_shorter_than_one_window_is_an_error(tmp_path):
    with pytest.raises(DatasetError, match="fewer than block_size \\+ 1"):
        make(tmp_path, "short", block_size=8)


def test_an_empty_file_is_an_error(tmp_path):
    with pytest.raises(DatasetError, match="is empty"):
        make(tmp_path, "")


def test_validation_region_too_small_for_one_window_is_an_error(tmp_path):
    with pytest.raises(DatasetError, match="validation region has 10 characters"):
        make(tmp_path, "x" * 100, block_size=16, split=0.9)


def test_unknown_prompt_characters_are_named(tmp_path):
    ds = make(tmp_path, "abcabcabcabc" * 5)
    with pytest.raises(ValueError, match="'z'"):
        ds.tokenizer.encode("abz")
