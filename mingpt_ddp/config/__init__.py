"""The job's configuration: one dataclass per section, the Hydra schema built from them, the
config groups, and --help. It imports no other part of the package."""
