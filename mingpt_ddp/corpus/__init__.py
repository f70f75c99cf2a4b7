"""Where the text comes from (files, globs, S3, fsspec, compressed), the prepare step that turns
it into token ids, and the order in which training visits the windows."""
