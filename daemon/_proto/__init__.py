"""Generated gRPC code for gpusnap.v1 (scripts/gen_protos.py). Do not edit."""
