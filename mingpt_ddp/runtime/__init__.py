"""The process group and the host: who this process is (rank, local rank, world size), the
collectives the trainer uses, CPU threads and memory, and the torch version check."""
