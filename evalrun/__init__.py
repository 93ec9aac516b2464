"""evalrun: offline LLM evaluation on a paged-KV dynamic generator."""

__version__ = "0.1.0"
