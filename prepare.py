"""The prepare step: a UTF-8 corpus in, a file of token ids out, once, for every rank that trains on it.

    python prepare.py data/tinyshakespeare/input.txt                # ahead of a job (main.py also does it)
    python prepare.py "books/*.txt" --cache-dir /scratch/prepared   # several files, concatenated in name order
    python prepare.py "s3://bucket/corpus/part-*.txt"               # S3 (boto3), or any fsspec URL
    python prepare.py data/prepared/input-0123456789ab --verify     # recompute a prepared copy's full checksum

Why: holding the text in memory costs every rank ~30 bytes per character (the str,
its code points, int64 ids), times the ranks on a node. Encoded once into a flat file
of ids, 1 byte per character (2 or 4 for vocabularies over 256 or 32767 characters),
the corpus is read window by window (char_dataset.TokenFile), so a rank's memory does
not grow with the corpus and the ranks of a node share one copy in the OS page cache.

One prepared copy per source, under data_config.cache_dir:

    meta.json                   vocabulary, dtype, counts, the source files' sizes and identities,
                                the token file's name and checksums. Written last: it is the commit.
    tokens-<sha256[:16]>.bin    the ids, little-endian. Named by content, never rewritten in place.

The source is streamed in chunks twice (mingpt_ddp/corpus/sources.py; pass 1 finds the vocabulary, pass 2 encodes), so
memory is bounded whatever its size. Several files are joined as they are, like `cat` (add a
trailing newline to each if they need one); a leading byte-order mark is dropped from each. A copy is reused while the source files keep the
sizes and identities in meta.json (mtime, S3 ETag, fsspec ukey) and the token file
passes its size and sampled-checksum checks; otherwise it is rebuilt, never trained on.
One process prepares while the others wait on a file lock, so the ranks of a node (or of
every node, on a shared filesystem) prepare it once.
"""

import sys

from mingpt_ddp.corpus.prepare import main

if __name__ == "__main__":
    sys.exit(main())
