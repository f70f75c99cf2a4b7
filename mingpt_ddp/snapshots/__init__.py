"""Where training state is written and read back: the store (files, manifest, checksums), the lease
(one writer per path), storage backends (local, S3, fsspec) and the save/resume protocol."""
