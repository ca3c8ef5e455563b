"""Generated agent-channel messages (scripts/gen_protos.py). Do not edit."""
