"""Device helpers shared by the kernels: fast math, movmatrix, copy helpers, the band scan, token prep."""
