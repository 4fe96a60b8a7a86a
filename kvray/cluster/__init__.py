"""Ray wiring and the engines: in-process (`LocalEngine`), the offline `LLM` API."""
