"""k3ray's eval harness: long-context needle tasks (gkamradt NIAH, RULER-style) and multimodal
needles, run against an OpenAI-compatible endpoint (`OpenAITarget`) or an oracle, with a
resumable per-cell JSONL log, a heatmap, and markdown / HTML reports. CLI: `k3ray eval`."""
