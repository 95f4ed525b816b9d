"""trainer torch package."""
