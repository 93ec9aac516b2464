"""evalrun: offline LLM evaluation on a paged-KV dynamic generator."""
import kernels  # noqa: F401  (first: it sets libgomp's spin before torch loads; kernels/__init__.py)

__version__ = "0.1.0"
