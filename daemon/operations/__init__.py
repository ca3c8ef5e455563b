"""operations."""
