"""Where the text is and how it is cut (config section `data_config`)."""

from __future__ import annotations

from dataclasses import dataclass

from mingpt_ddp.errors import ConfigError

DEFAULT_CACHE_DIR = "data/prepared"  # prepared token files, one subdirectory per source


@dataclass
class DataConfig:
    """Where the text is and how it is cut (config section `data_config`)."""

    path: str = "data/tinyshakespeare/input.txt"
    """UTF-8 text: a local path (relative to where you launch), an s3:// or fsspec URL, a glob of
    several files ('books/*.txt', concatenated in name order), or a directory prepare.py made."""
    block_size: int = 64
    """Context length T: characters the model sees at once."""
    train_split: float = 0.9
    """Fraction of the text (from the start) used for training; the rest is validation."""
    cache_dir: str = DEFAULT_CACHE_DIR
    """Where prepared token files go (one subdirectory per source): local disk, or a filesystem the
    nodes share so that the corpus is prepared once for the whole job."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("data_config.path must name a UTF-8 text file")
        if self.block_size <= 0:
            raise ConfigError(f"data_config.block_size must be positive, got {self.block_size}")
        if not 0.0 < self.train_split < 1.0:
            raise ConfigError(f"data_config.train_split must be in (0, 1), got {self.train_split}")
        if not self.cache_dir:
            raise ConfigError(
                "data_config.cache_dir must name a directory for prepared token files"
            )
