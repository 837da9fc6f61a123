"""CuTe DSL kernels, one class per module. Importing this package needs no GPU."""
