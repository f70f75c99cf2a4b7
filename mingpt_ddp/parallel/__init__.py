"""How the model is spread over the ranks (DDP, FSDP2, DeepSpeed ZeRO) and in which precision it
computes."""
