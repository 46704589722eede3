"""Structured output: grammar compilation (its workers), grammar masks, and the logits processors."""
