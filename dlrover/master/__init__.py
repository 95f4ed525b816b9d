"""master package."""
