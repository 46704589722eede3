"""The Triton launches `k3ray bench compile` compiles for a GPU, one module per op folder of
k3ray.kernels, each with `launches() -> list[dict]` (keys op, shape, fn: a Triton launcher called on
CPU tensors at K3's shapes)."""
