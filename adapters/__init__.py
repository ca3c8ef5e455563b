"""gpusnap adapters: code that runs inside engine worker processes (worker agent, engine adapters).

Keep dependencies light: this package is imported by inference workers.
"""
