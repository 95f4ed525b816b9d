"""Elastic embedding servers: sparse tables partitioned by virtual buckets (in progress)."""
