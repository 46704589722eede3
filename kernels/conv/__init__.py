from k3ray.kernels.conv.dispatch import causal_conv1d, causal_conv1d_spec, causal_conv1d_update

__all__ = ["causal_conv1d", "causal_conv1d_spec", "causal_conv1d_update"]
