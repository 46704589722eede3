"""k3ray.kernels: one folder per op, each a `naive.py` reference beside its fast paths and one
dispatcher entry that the model calls."""
