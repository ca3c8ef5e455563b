"""The remote store: snapshots on S3-compatible object storage, as content-addressed chunks (docs/fleet.md)."""
