"""Logits -> tokens: sampling, and speculative drafts with their verification."""
