"""Elastic data loading for PyTorch: shard sampler, data loader, fixed-global-batch trainer."""
