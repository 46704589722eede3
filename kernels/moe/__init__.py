from k3ray.kernels.moe.dispatch import moe_experts, select_experts
from k3ray.kernels.moe.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from k3ray.kernels.moe.naive import situ_glu

__all__ = ["dequantize_mxfp4", "moe_experts", "quantize_mxfp4", "select_experts", "situ_glu"]
