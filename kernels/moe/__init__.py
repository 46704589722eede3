from k3ray.kernels.moe.dispatch import moe_experts, route
from k3ray.kernels.moe.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from k3ray.kernels.moe.naive import situ_glu

__all__ = ["dequantize_mxfp4", "moe_experts", "quantize_mxfp4", "route", "situ_glu"]
