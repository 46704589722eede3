"""Prefill/decode disaggregation: what a prefill engine hands a decode engine, and its transfer."""
