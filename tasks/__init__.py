import kernels  # noqa: F401  (first: it sets libgomp's spin before torch loads; kernels/__init__.py)
