"""The cases `k3ray bench kernels` times, one module per op folder of k3ray.kernels, each with
`cases(device, quick) -> list[dict]` (keys op, shape, fn, bytes, flops, optional baselines: see
baselines.py) and the op's shapes at K3 and k3-tiny."""
