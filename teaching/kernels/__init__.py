"""The teaching kernels, one class per module, in the CuTe DSL. Importing this package needs no GPU."""
