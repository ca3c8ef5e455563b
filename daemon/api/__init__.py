"""Domain types and errors shared by every layer; imports no gRPC."""
