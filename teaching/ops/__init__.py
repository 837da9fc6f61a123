"""Torch launchers of the teaching kernels: checked tensors in, a launch on the current stream."""
