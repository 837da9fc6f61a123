"""Torch-facing launchers of the kernels: validated tensors in, launches on the current stream.

The kernel classes in ``cute_kda.kernels`` know nothing of torch; these modules convert tensors,
own the compile caches and launch. The public API (``cute_kda.api``) sits on top.
"""
