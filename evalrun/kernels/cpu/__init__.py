"""Native CPU kernels: C sources (csrc/), built on first use by native.py, and their ctypes wrappers."""
