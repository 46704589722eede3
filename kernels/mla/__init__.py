from k3ray.kernels.mla.dispatch import mla_decode, mla_prefill, mla_prefill_paged

__all__ = ["mla_decode", "mla_prefill", "mla_prefill_paged"]
