"""DLRover: elastic, fault-tolerant distributed training for PyTorch."""

__version__ = "0.1.0"
