"""The prepare step, as a command: a UTF-8 corpus in, a file of token ids out, ahead of a job
(main.py does the same on first use; how and why: mingpt_ddp/corpus/prepare.py).

    python prepare.py data/tinyshakespeare/input.txt                # ahead of a job
    python prepare.py "books/*.txt" --cache-dir /scratch/prepared   # several files, concatenated
                                                                    # in name order
    python prepare.py "s3://bucket/corpus/part-*.txt"               # S3 (boto3), or any fsspec URL
    python prepare.py "books/*.txt.gz"                              # compressed (.gz .bz2 .xz .zst)
    python prepare.py data/prepared/input-0123456789ab --verify     # recompute a prepared copy's
                                                                    # full checksum
"""

import sys

from mingpt_ddp.corpus.prepare import main

if __name__ == "__main__":
    sys.exit(main())
