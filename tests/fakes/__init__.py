"""Test doubles for drivers that need hardware (the CUDA checkpoint API) — CI has no GPU."""
