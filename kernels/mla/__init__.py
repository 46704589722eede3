from k3ray.kernels.mla.dispatch import mla_decode, mla_prefill

__all__ = ["mla_decode", "mla_prefill"]
