"""The front: OpenAI-compatible serving (Ray Serve), tokenizer plumbing, metrics, CLI."""
