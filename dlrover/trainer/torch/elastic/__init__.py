"""Elastic data loading for PyTorch: DLRover's resumable sampler, the master's dynamic shards, a
data loader whose batch size can change, the fixed-global-batch trainer, and a Kafka stream
dataset."""

from dlrover.trainer.torch.elastic.dataloader import ElasticDataLoader
from dlrover.trainer.torch.elastic.dynamic_sampler import DynamicShardSampler
from dlrover.trainer.torch.elastic.sampler import ElasticDistributedSampler
from dlrover.trainer.torch.elastic.stream import ElasticStreamDataset, KafkaRecord
from dlrover.trainer.torch.elastic.trainer import ElasticTrainer

__all__ = [
    "DynamicShardSampler",
    "ElasticDataLoader",
    "ElasticDistributedSampler",
    "ElasticStreamDataset",
    "ElasticTrainer",
    "KafkaRecord",
]
