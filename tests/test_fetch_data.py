"""Getting the corpus: the fetch script verifies what it writes, and main.py fetches the default
once."""

import pytest
from conftest import free_port, run_main, tiny_overrides

from data.fetch_shakespeare import SIZE, FetchError, ensure_tinyshakespeare


def test_fetch_from_a_local_file_verifies_and_writes_it(shakespeare, tmp_path):
    dest = tmp_path / "out" / "input.txt"
    assert ensure_tinyshakespeare(str(dest), str(shakespeare)) == str(dest)
    assert dest.stat().st_size == SIZE


def test_fetch_refuses_a_file_that_is_not_tiny_shakespeare(tmp_path):
    wrong = tmp_path / "wrong.txt"
    wrong.write_text("not shakespeare")
    with pytest.raises(FetchError, match="is not tiny Shakespeare"):
        ensure_tinyshakespeare(str(tmp_path / "input.txt"), str(wrong))
    assert not (tmp_path / "input.txt").exists()


def test_fetch_from_an_unreachable_url_fails_fast(tmp_path):
    with pytest.raises(FetchError, match="cannot fetch"):
        ensure_tinyshakespeare(
            str(tmp_path / "input.txt"), f"http://127.0.0.1:{free_port()}/input.txt", timeout_s=5
        )


def _default_path_args(tmp_path):
    # All of TINY's settings, but without data_config.path: the default relative path is used.
    return [
        a
        for a in tiny_overrides(tmp_path / "unused", tmp_path / "run", max_steps=2)
        if not a.startswith("data_config.path=")
    ]


@pytest.mark.slow
def test_main_fetches_the_default_corpus_once_per_node_then_trains(shakespeare, tmp_path):
    result = run_main(
        _default_path_args(tmp_path),
        nproc=2,
        cwd=tmp_path,
        env={"TINYSHAKESPEARE_URL": shakespeare.as_uri()},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("fetching tiny Shakespeare") == 1
    assert (tmp_path / "data" / "tinyshakespeare" / "input.txt").stat().st_size == SIZE


@pytest.mark.slow
def test_main_offline_fails_fast_naming_data_config_path(tmp_path):
    result = run_main(
        _default_path_args(tmp_path),
        cwd=tmp_path,
        env={"TINYSHAKESPEARE_URL": f"http://127.0.0.1:{free_port()}/input.txt"},
    )
    assert result.returncode == 1
    assert "error: data_config.path: cannot fetch tiny Shakespeare" in result.stderr
    assert "Traceback" not in result.stderr
