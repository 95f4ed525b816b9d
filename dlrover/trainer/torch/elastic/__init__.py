"""Elastic data loading for PyTorch: shard sampler, data loader, fixed-global-batch trainer, and
a Kafka stream dataset."""

from dlrover.trainer.torch.elastic.sampler import ElasticDistributedSampler
from dlrover.trainer.torch.elastic.stream import ElasticStreamDataset, KafkaRecord

__all__ = ["ElasticDistributedSampler", "ElasticStreamDataset", "KafkaRecord"]
