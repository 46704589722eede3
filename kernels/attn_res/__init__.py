from k3ray.kernels.attn_res.dispatch import attn_res, attn_res_rmsnorm

__all__ = ["attn_res", "attn_res_rmsnorm"]
