"""The README's cheap exercises, run: each says what you should see, and here it is seen. (The
others are covered where their subject is tested: the stall report in test_hang_lab.py, torchft's
heal in test_torchft.py, the restarts in test_elastic.py.)"""

import sys

import pytest
from conftest import REPO, run_python

from benchmarks.common import RANKS

README = (REPO / "README.md").read_text()


@pytest.mark.slow
def test_the_bucket_cap_exercise_prints_what_the_readme_says():
    assert "to 2 buckets and 65%, then 1 bucket and 0%" in README
    out = run_python(
        [sys.executable, RANKS, "2", REPO / "tutorials" / "ddp_buckets.py", "--bucket-cap-mb", "2"]
    ).stdout
    assert "At bucket_cap_mb=2: 2 buckets, 1 sent while backward was still running, with 65%" in out


@pytest.mark.slow
def test_a_chinese_text_is_held_in_int16_ids(tmp_path):
    assert "the `data |` line says `int16 ids` where Shakespeare had\n`uint8`" in README
    # More than 255 distinct characters (CJK), fewer than 32,768: int16 holds every id.
    text = "".join(chr(0x4E00 + (i * 7919) % 3000) for i in range(20_000)) + "。\n"
    corpus = tmp_path / "novel.txt"
    corpus.write_text(text, encoding="utf-8")
    result = run_python(
        [sys.executable, REPO / "prepare.py", corpus, "--cache-dir", tmp_path / "p"]
    )
    assert result.returncode == 0, result.stderr
    assert "int16 ids" in result.stdout + result.stderr
