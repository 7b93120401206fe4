"""Measurement above the API: `bench` (speculative vs plain decoding per category), `profile`
(latency curves), `tune` (the draft shape per batch size) and `datasets` (prompt sets)."""
