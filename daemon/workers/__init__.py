"""The daemon's side of worker agents and of the control-directory contract."""
