"""Compressed corpora: .gz, .bz2, .xz (and .zst with the zstandard package) are decoded while the
corpus is prepared, locally, in a glob and on S3, and give the very token file the plain text
gives."""

import bz2
import gzip
import lzma

import pytest
from conftest import sweep, sweep_jobs, sweep_overrides

from mingpt_ddp.corpus import sources
from mingpt_ddp.corpus.prepare import ensure_prepared
from mingpt_ddp.errors import DatasetError

COMPRESS = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}
try:
    import zstandard

    COMPRESS[".zst"] = lambda data: zstandard.ZstdCompressor().compress(data)
except ImportError:  # the zstd case is tested where the package is installed (the test extra)
    pass


def quiet(line: str) -> None:
    pass


@pytest.fixture(scope="module")
def text(shakespeare) -> bytes:
    return shakespeare.read_bytes()[:200_000]


@pytest.fixture(scope="module")
def corpora(text, tmp_path_factory) -> dict:
    """The same text written plain and in every compressed format."""
    folder = tmp_path_factory.mktemp("corpora")
    files = {".txt": folder / "input.txt"}
    files[".txt"].write_bytes(text)
    for suffix, compress in COMPRESS.items():
        files[suffix] = folder / f"input.txt{suffix}"
        files[suffix].write_bytes(compress(text))
    return files


def test_every_format_gives_the_plain_texts_token_file(corpora, tmp_path):
    plain = ensure_prepared(str(corpora[".txt"]), str(tmp_path), log=quiet)
    for suffix, path in corpora.items():
        prepared = ensure_prepared(str(path), str(tmp_path), log=quiet)
        assert prepared.directory != plain.directory or suffix == ".txt"  # its own cache entry
        assert open(prepared.tokens_path, "rb").read() == open(plain.tokens_path, "rb").read(), (
            suffix
        )
        assert prepared.meta["vocab"] == plain.meta["vocab"]
        # The cache's identity is the compressed file's: its size as stored, not the text's.
        assert prepared.meta["files"][0]["bytes"] == path.stat().st_size


def test_a_compressed_source_is_read_in_bounded_blocks(corpora, monkeypatch):
    monkeypatch.setattr(sources, "CHUNK_BYTES", 4096)
    [source] = sources.find_sources(str(corpora[".gz"]))
    blocks = list(source.open_blocks())
    assert max(map(len, blocks)) <= 4096 and len(blocks) > 40


def test_a_glob_of_compressed_files_and_a_damaged_one(corpora, text, tmp_path):
    folder = tmp_path / "parts"
    folder.mkdir()
    (folder / "a.txt.gz").write_bytes(gzip.compress(text[:1000]))
    (folder / "b.txt.xz").write_bytes(lzma.compress(text[1000:3000]))
    prepared = ensure_prepared(str(folder / "*.txt.*"), str(tmp_path / "cache"), log=quiet)
    assert prepared.meta["num_tokens"] == len(text[:3000].decode())
    (folder / "c.txt.gz").write_bytes(gzip.compress(text)[:500])  # cut short
    with pytest.raises(DatasetError, match=r"cannot read .*c\.txt\.gz \(EOFError"):
        ensure_prepared(str(folder / "c.txt.gz"), str(tmp_path / "cache"), log=quiet)


def test_a_zip_archive_is_refused_with_the_fix(tmp_path):
    (tmp_path / "corpus.zip").write_bytes(b"PK\x05\x06" + bytes(18))
    with pytest.raises(DatasetError, match="zip archive, not one compressed file; unzip it"):
        sources.find_sources(str(tmp_path / "corpus.zip"))


def test_a_compressed_s3_object_is_decoded_while_it_is_prepared(s3, bucket, corpora, tmp_path):
    plain = ensure_prepared(str(corpora[".txt"]), str(tmp_path), log=quiet)
    client = s3.client()
    for suffix in (".gz", ".xz"):
        client.put_object(
            Bucket=bucket, Key=f"data/input.txt{suffix}", Body=corpora[suffix].read_bytes()
        )
        prepared = ensure_prepared(
            f"s3://{bucket}/data/input.txt{suffix}", str(tmp_path), s3.url, log=quiet
        )
        assert open(prepared.tokens_path, "rb").read() == open(plain.tokens_path, "rb").read(), (
            suffix
        )
        assert prepared.meta["files"][0]["identity"]["etag"]


@pytest.mark.slow
def test_training_on_each_format_gives_the_same_first_losses(corpora, tmp_path):
    # One sweep, one process (one torch start-up): a job per format, each in its own directory.
    paths = ",".join(
        str(p) for suffix, p in corpora.items() if suffix != ".zst"
    )  # zstd: same tokens, above
    result = sweep(
        [
            *sweep_overrides(corpora[".txt"], tmp_path, max_steps=3, log_every=1, eval_every=3),
            f"data_config.path={paths}",
        ],
        tmp_path / "sweep",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    losses = [
        [r["train_loss"] for r in records if "train_loss" in r]
        for records in sweep_jobs(tmp_path / "sweep").values()
    ]
    assert len(losses) == 4 and len(losses[0]) == 3
    assert all(found == losses[0] for found in losses), losses
