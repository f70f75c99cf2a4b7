"""The machinery under the story (main.py -> trainer.py, model.py, char_dataset.py): each
sub-package owns one thing, and none imports the story's modules.

    config/     the job's config sections, the Hydra schema, the config groups, --help
    runtime/    the process group and the host: ranks, collectives, threads, versions
    parallel/   how the model is spread over the ranks: DDP, FSDP2, DeepSpeed ZeRO, precision
    snapshots/  where training state is written and read: store, manifest, lease, storage, protocol
    corpus/     where text comes from and how it becomes token ids, and the data order
    mingpt_ddp/optim.py    the optimizers (AdamW, Muon) and the learning-rate schedule
    mingpt_ddp/metrics.py  the metrics file, TensorBoard, the progress line
    mingpt_ddp/urls.py     reaching a path or URL (local, S3, fsspec), for corpus/ and snapshots/
    errors.py   the mistakes a user can fix, as exception types
"""
