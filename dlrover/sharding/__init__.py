"""sharding package."""
