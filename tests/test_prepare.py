"""The prepare step's cache: reused when valid, rebuilt when stale or damaged (never trained on),
safe when killed or run by several processes at once, and fed from local files, globs and S3."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from s3_server import CREDENTIALS

from char_dataset import CharDataset, DataConfig, DatasetError, TokenFile
from mingpt_ddp.corpus import prepare, sources
from mingpt_ddp.corpus.prepare import ensure_prepared, sampled_sha256, verify
from mingpt_ddp.errors import DatasetError as PrepareError

assert DatasetError is PrepareError  # one error type for "the corpus cannot be used"


class Log(list):
    def __call__(self, line: str) -> None:
        self.append(line)

    def prepared(self) -> bool:
        return any(line.startswith("data | preparing") for line in self)


def ids(prepared) -> torch.Tensor:
    return TokenFile(prepared.tokens_path, prepared.dtype, prepared.meta["num_tokens"]).read(
        0, prepared.meta["num_tokens"]
    )


def decoded(prepared) -> str:
    return "".join(prepared.meta["vocab"][i] for i in ids(prepared).tolist())


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("First Citizen: we are accounted poor citizens.\n" * 2000, encoding="utf-8")
    return path


def test_a_second_run_reuses_the_prepared_copy(corpus, tmp_path):
    first_log, second_log = Log(), Log()
    first = ensure_prepared(str(corpus), str(tmp_path / "cache"), log=first_log)
    mtime = os.stat(first.tokens_path).st_mtime_ns
    second = ensure_prepared(str(corpus), str(tmp_path / "cache"), log=second_log)
    assert first_log.prepared() and not second_log.prepared()
    assert (
        second.tokens_path == first.tokens_path and os.stat(second.tokens_path).st_mtime_ns == mtime
    )
    assert decoded(second) == corpus.read_text()


def test_the_metadata_names_the_source_its_identity_and_the_counts(corpus, tmp_path):
    meta = ensure_prepared(str(corpus), str(tmp_path / "cache"), log=Log()).meta
    stat = corpus.stat()
    assert meta["files"] == [
        {
            "url": str(corpus),
            "bytes": stat.st_size,
            "identity": {
                "mtime_ns": stat.st_mtime_ns,
                "ctime_ns": stat.st_ctime_ns,
                "inode": stat.st_ino,
            },
        }
    ]
    assert meta["num_tokens"] == len(corpus.read_text()) and meta["dtype"] == "uint8"
    assert meta["vocab"] == "".join(sorted(set(corpus.read_text())))


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "meta"])
def test_a_truncated_or_damaged_copy_is_rebuilt_not_trained_on(damage, corpus, tmp_path):
    prepared = ensure_prepared(str(corpus), str(tmp_path / "cache"), log=Log())
    path = prepared.tokens_path
    if damage == "truncate":
        os.truncate(path, os.path.getsize(path) // 2)
    elif damage == "flip":
        with open(path, "r+b") as f:
            f.write(b"\xff\xff")  # same size, different content at the start
    elif damage == "delete":
        os.remove(path)
    else:
        (tmp_path / "cache" / os.path.basename(prepared.directory) / "meta.json").write_text(
            "{not json"
        )
    log = Log()
    again = ensure_prepared(str(corpus), str(tmp_path / "cache"), log=log)
    assert log.prepared()
    assert decoded(again) == corpus.read_text()


def test_a_changed_source_is_detected_and_prepared_again(corpus, tmp_path):
    ensure_prepared(str(corpus), str(tmp_path / "cache"), log=Log())
    corpus.write_text(
        corpus.read_text().replace("poor", "rich")
    )  # same length, new content (and mtime)
    log = Log()
    again = ensure_prepared(str(corpus), str(tmp_path / "cache"), log=log)
    assert any("the source changed since it was prepared" in line for line in log)
    assert decoded(again) == corpus.read_text()
    assert len(list((tmp_path / "cache").rglob("tokens-*.bin"))) == 1  # the old version is removed


def test_a_glob_concatenates_files_in_name_order_and_notices_a_new_file(tmp_path):
    books = tmp_path / "books"
    books.mkdir()
    (books / "b.txt").write_text("second book\n")
    (books / "a.txt").write_text("first book\n")
    (books / "notes.md").write_text("not matched\n")
    spec = str(books / "*.txt")
    assert (
        decoded(ensure_prepared(spec, str(tmp_path / "cache"), log=Log()))
        == "first book\nsecond book\n"
    )
    (books / "c.txt").write_text("third book\n")
    log = Log()
    assert (
        decoded(ensure_prepared(spec, str(tmp_path / "cache"), log=log))
        == "first book\nsecond book\nthird book\n"
    )
    assert any("2 -> 3 files" in line for line in log)


def test_a_directory_without_a_glob_is_refused_with_the_fix(tmp_path):
    with pytest.raises(DatasetError, match=r"is a directory; name its files with a glob"):
        ensure_prepared(str(tmp_path), str(tmp_path / "cache"))


def test_a_prepared_directory_can_be_the_data_path_without_its_source(corpus, tmp_path):
    prepared = ensure_prepared(str(corpus), str(tmp_path / "cache"), log=Log())
    text = corpus.read_text()
    corpus.unlink()  # e.g. prepared on a workstation, copied to the cluster
    ds = CharDataset(
        DataConfig(path=prepared.directory, block_size=8, cache_dir=str(tmp_path / "unused")),
        log=Log(),
    )
    assert ds.tokenizer.decode(ds.tokens.read(0, ds.num_tokens)) == text
    os.truncate(prepared.tokens_path, 10)
    with pytest.raises(DatasetError, match="is a prepared copy, but .* has 10 bytes"):
        ensure_prepared(prepared.directory)


def test_an_unwritable_cache_dir_names_the_setting(corpus, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory should go")
    with pytest.raises(
        DatasetError, match="data_config.cache_dir: cannot write in .*not prepared yet"
    ):
        ensure_prepared(str(corpus), str(blocker / "cache"))


def test_a_full_disk_is_a_one_line_error_that_leaves_nothing_behind(shakespeare, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(small)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with pytest.raises(
            DatasetError,
            match=r"data_config.cache_dir: cannot write .*No space left on device.*"
            r"free space or set data_config.cache_dir=",
        ):
            ensure_prepared(
                str(shakespeare), str(small / "cache"), log=Log()
            )  # 1.1 MB of ids into 512 KiB
        leftovers = [
            p.name for p in (small / "cache").rglob("*") if p.is_file() and p.name != ".lock"
        ]
        assert leftovers == []
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_a_file_name_with_glob_characters_is_taken_literally(tmp_path):
    (tmp_path / "v[1].txt").write_text("the real one\n")
    (tmp_path / "v1.txt").write_text("what the pattern would match\n")
    assert (
        decoded(ensure_prepared(str(tmp_path / "v[1].txt"), str(tmp_path / "cache"), log=Log()))
        == "the real one\n"
    )


def test_a_same_size_rewrite_that_keeps_the_mtime_is_still_noticed(corpus, tmp_path):
    ensure_prepared(str(corpus), str(tmp_path / "cache"), log=Log())
    stat = corpus.stat()
    corpus.write_text(corpus.read_text().replace("we", "us"))  # same size
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # what cp -p, rsync -a, touch -r do
    assert corpus.stat().st_mtime_ns == stat.st_mtime_ns
    log = Log()
    assert (
        decoded(ensure_prepared(str(corpus), str(tmp_path / "cache"), log=log))
        == corpus.read_text()
    )
    assert log.prepared()


def test_a_read_failure_mid_prepare_is_a_one_line_error_naming_the_file():
    def failing():
        yield b"some text\n"
        raise OSError(5, "Input/output error")

    source = sources.SourceFile("/data/corpus.txt", 100, {}, failing)
    with pytest.raises(
        DatasetError,
        match=r"^data_config.path: cannot read /data/corpus.txt \(OSError: .*Input/output",
    ):
        list(sources.chunks(source))


def test_a_leading_byte_order_mark_is_not_text(tmp_path):
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_bytes("\ufeff".encode() + f"{name} body\n".encode())
    prepared = ensure_prepared(str(tmp_path / "*.txt"), str(tmp_path / "cache"), log=Log())
    assert (
        decoded(prepared) == "a.txt body\nb.txt body\n" and "\ufeff" not in prepared.meta["vocab"]
    )


def test_fsspec_identity_ignores_access_times():
    info = {"name": "/x", "size": 3, "type": "file", "mtime": 1700000000.5, "atime": 1700000999.0}
    assert sources._fsspec_identity(None, "/x", info) == {"mtime": "1700000000.5"}


def mounted(path, size: str) -> bool:
    path.mkdir(exist_ok=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


def test_no_room_for_meta_json_after_the_token_file_leaves_nothing_behind(tmp_path):
    corpus = tmp_path / "fill.txt"
    corpus.write_bytes(b"ab" * (256 << 10))  # 512 KiB of uint8 ids: they fill the whole filesystem
    if not mounted(tmp_path / "small", "512k"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with pytest.raises(
            DatasetError, match="data_config.cache_dir: cannot write .*No space left"
        ):
            ensure_prepared(str(corpus), str(tmp_path / "small" / "cache"), log=Log())
        assert [p.name for p in (tmp_path / "small").rglob("*") if p.is_file()] == [".lock"]
    finally:
        subprocess.run(["umount", str(tmp_path / "small")], check=True)


def test_a_stale_copy_in_a_read_only_cache_dir_is_a_one_line_error(corpus, tmp_path):
    if not mounted(tmp_path / "ro", "4m"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        ensure_prepared(str(corpus), str(tmp_path / "ro" / "cache"), log=Log())
        corpus.write_text("the source moved on\n" * 100)
        subprocess.run(["mount", "-o", "remount,ro", str(tmp_path / "ro")], check=True)
        with pytest.raises(
            DatasetError,
            match=r"cannot write in .*Read-only file system.*the source changed.*"
            r"set data_config.cache_dir=",
        ):
            ensure_prepared(str(corpus), str(tmp_path / "ro" / "cache"), log=Log())
    finally:
        subprocess.run(["umount", str(tmp_path / "ro")], check=True)


@pytest.mark.slow
def test_sampling_catches_cheap_damage_and_verify_catches_the_rest(tmp_path):
    corpus = tmp_path / "big.txt"
    corpus.write_bytes(bytes(range(32, 127)) * 60_000)  # 5.7 MB
    prepared = ensure_prepared(str(corpus), str(tmp_path / "cache"), log=Log())
    size = os.path.getsize(prepared.tokens_path)
    between_spans = (size - 65536) // 16 + 65536 + 100  # after the 2nd sampled span, before the 3rd
    with open(prepared.tokens_path, "r+b") as f:
        f.seek(between_spans)
        f.write(b"\x00")
    assert sampled_sha256(prepared.tokens_path, size) == prepared.meta["tokens_sampled_sha256"]
    with pytest.raises(DatasetError, match="sha256 mismatch"):
        verify(prepared)
    cli = subprocess.run(
        [sys.executable, str(REPO / "prepare.py"), prepared.directory, "--verify"],
        capture_output=True,
        text=True,
    )
    assert (
        cli.returncode == 1 and cli.stderr.startswith("error:") and "sha256 mismatch" in cli.stderr
    )


@pytest.mark.slow
def test_the_command_line_prepares_ahead_of_a_job(corpus, tmp_path):
    cli = subprocess.run(
        [sys.executable, str(REPO / "prepare.py"), str(corpus), "--cache-dir", str(tmp_path / "c")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert cli.returncode == 0, cli.stderr
    assert "ready |" in cli.stdout and f"{len(corpus.read_text()):,} uint8 ids" in cli.stdout
    log = Log()  # the job then finds it prepared
    CharDataset(DataConfig(path=str(corpus), cache_dir=str(tmp_path / "c")), log=log)
    assert not log.prepared()


def paused(fifo, corpus, cache) -> subprocess.Popen:
    """A preparer stopped in the middle of writing its token file (tests/paused_prepare.py)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "tests" / "paused_prepare.py"),
            str(fifo),
            str(corpus),
            "--cache-dir",
            str(cache),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in proc.stdout:
        if line.strip() == "paused":
            return proc
    raise AssertionError(f"the preparer never paused (exit {proc.wait()})")


@pytest.mark.slow
def test_a_preparer_killed_mid_write_leaves_nothing_to_train_on_and_the_next_run_cleans_up(
    corpus, tmp_path
):
    fifo, cache = tmp_path / "fifo", tmp_path / "cache"
    os.mkfifo(fifo)
    proc = paused(fifo, corpus, cache)
    directory = cache / os.path.basename(prepare.prepared_dir(str(corpus), str(cache)))
    assert [p.name for p in directory.glob(".tokens-*.tmp")] and not (
        directory / "meta.json"
    ).exists()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    log = Log()
    prepared = ensure_prepared(str(corpus), str(cache), log=log)
    assert any("not prepared yet" in line for line in log)
    assert decoded(prepared) == corpus.read_text()
    assert not list(directory.glob(".*.tmp"))  # the killed run's temporary file is gone


@pytest.mark.slow
def test_two_preparers_at_once_prepare_once_and_both_get_the_same_copy(corpus, tmp_path):
    fifo, cache = tmp_path / "fifo", tmp_path / "cache"
    os.mkfifo(fifo)
    first = paused(fifo, corpus, cache)  # holds the lock, half-way through writing
    second = subprocess.Popen(
        [sys.executable, str(REPO / "prepare.py"), str(corpus), "--cache-dir", str(cache)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    waiting = second.stdout.readline()
    assert "another process is preparing" in waiting and "waiting for it" in waiting
    open(fifo, "w").close()  # let the first one finish
    first_out, _ = first.communicate(timeout=60)
    second_out, _ = second.communicate(timeout=60)
    assert first.returncode == 0 and second.returncode == 0, first_out + second_out
    assert "data | prepared" in first_out and "data | preparing" not in second_out
    prepared = ensure_prepared(str(corpus), str(cache), log=Log())
    assert decoded(prepared) == corpus.read_text()


def test_an_s3_source_is_prepared_and_a_changed_object_prepared_again(s3, bucket, tmp_path):
    client = s3.client()
    client.put_object(
        Bucket=bucket, Key="corpus/text.txt", Body="héllo wörld, S3 text\n".encode() * 500
    )
    url, cache = f"s3://{bucket}/corpus/text.txt", str(tmp_path / "cache")
    prepared = ensure_prepared(url, cache, s3.url, log=Log())
    assert decoded(prepared) == "héllo wörld, S3 text\n" * 500
    assert prepared.meta["files"][0]["identity"]["etag"]
    log = Log()
    assert decoded(ensure_prepared(url, cache, s3.url, log=log)) == "héllo wörld, S3 text\n" * 500
    assert not log.prepared()
    client.put_object(Bucket=bucket, Key="corpus/text.txt", Body=b"replaced text\n" * 300)
    log = Log()
    assert decoded(ensure_prepared(url, cache, s3.url, log=log)) == "replaced text\n" * 300
    assert any("the source changed" in line for line in log)


def test_an_s3_object_replaced_while_it_is_read_is_a_one_line_error(s3, bucket):
    client = s3.client()
    client.put_object(Bucket=bucket, Key="text.txt", Body=b"version one\n")
    [source] = sources.find_sources(f"s3://{bucket}/text.txt", s3.url)
    client.put_object(
        Bucket=bucket, Key="text.txt", Body=b"version two\n"
    )  # between listing and reading
    with pytest.raises(DatasetError, match="text.txt changed while it was being prepared"):
        list(sources.chunks(source))


def test_an_s3_glob_takes_the_matching_objects_in_name_order(s3, bucket, tmp_path):
    client = s3.client()
    for key, body in [
        ("shards/part-1.txt", "one\n"),
        ("shards/part-0.txt", "zero\n"),
        ("shards/skip.md", "no\n"),
        ("shards/deeper/part-2.txt", "not at this level\n"),
        ("shards/", ""),
    ]:
        client.put_object(Bucket=bucket, Key=key, Body=body.encode())
    prepared = ensure_prepared(
        f"s3://{bucket}/shards/part-*.txt", str(tmp_path / "cache"), s3.url, log=Log()
    )
    assert decoded(prepared) == "zero\none\n"


def test_a_missing_s3_object_or_endpoint_is_a_one_line_error(s3, bucket, tmp_path):
    with pytest.raises(DatasetError, match="data_config.path: no file at"):
        ensure_prepared(f"s3://{bucket}/nothing.txt", str(tmp_path), s3.url)
    with pytest.raises(DatasetError, match="cannot read .*s3_endpoint_url"):
        ensure_prepared(
            f"s3://{bucket}/x.txt", str(tmp_path), "http://127.0.0.1:9"
        )  # nothing listens there


def test_training_reads_an_s3_corpus_end_to_end(s3, bucket, shakespeare, tmp_path):
    from conftest import run_main, tiny_overrides

    s3.client().put_object(
        Bucket=bucket, Key="data/input.txt", Body=shakespeare.read_bytes()[:100_000]
    )
    args = tiny_overrides(shakespeare, tmp_path, max_steps=3, eval_every=3) + [
        f"data_config.path=s3://{bucket}/data/input.txt",
        f"data_config.cache_dir={tmp_path / 'cache'}",
        f"trainer_config.s3_endpoint_url={s3.url}",
    ]
    result = run_main(args, env=CREDENTIALS)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"data | s3://{bucket}/data/input.txt | 100,000 characters" in result.stdout
    assert "eval | step 3 | val loss" in result.stdout
    meta = json.loads(next((tmp_path / "cache").rglob("meta.json")).read_text())
    assert meta["files"][0]["url"] == f"s3://{bucket}/data/input.txt"
