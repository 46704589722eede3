from k3ray.kernels.kda.dispatch import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_spec
from k3ray.kernels.kda.naive import kda_gate, l2norm

__all__ = ["chunk_kda", "fused_recurrent_kda", "fused_recurrent_kda_spec", "kda_gate", "l2norm"]
