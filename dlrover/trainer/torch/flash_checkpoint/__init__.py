"""Flash checkpointing for PyTorch training scripts (DDP, FSDP)."""
