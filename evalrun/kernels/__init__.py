"""Kernels: a torch reference for every op and fast versions beside it, chosen once per cache.

    backend.py    backends and the KernelPlan they resolve (one callable per op, what the manifest records)
    kv_format.py  the KV cache formats and one layer's storage (LayerKV)
    attention.py  the metadata of a packed batch's paged attention
    linear.py     which kernel each linear weight is packed for
    ref/          torch references (CPU and CUDA)
    cpu/          native CPU kernels: C sources (csrc/) and their ctypes wrappers
    cuda/         Triton kernels (jitted on first use) and flash-attn

The process settings these kernels want (libgomp's spin, glibc malloc thresholds) are applied by
`import evalrun` (evalrun/process.py, evalrun/malloc_tuning.py), which runs before this package is
imported. cpu/huge_pages.py (2 MiB pages for large buffers) and cpu/host.py (the CPU's flags) stay
here: they set no process-wide state (huge pages are advised per buffer, on its own mapping).
"""
