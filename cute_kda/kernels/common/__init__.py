"""Device helpers shared by the kernels: fast math, movmatrix, named barriers, copy helpers."""
