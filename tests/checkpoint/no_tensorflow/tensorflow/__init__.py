"""Stands in for TensorFlow in the Megatron tests' ranks: `without_tensorflow` in harness.py."""

raise ImportError("TensorFlow is hidden from this test's processes (tests/checkpoint/harness.py)")
