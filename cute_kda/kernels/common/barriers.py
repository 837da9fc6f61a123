"""Named barrier ids (0 is ``__syncthreads``). One enum for every kernel keeps ids from colliding."""

from enum import IntEnum


class NamedBarrier(IntEnum):
    MMA_WARPS = 1  # the compute warps of K2 between phases that share smem
    STORE_READY = 2  # compute warps → store warp hand-off outside a pipeline
    EPILOGUE = 3  # state write-back after the last tile
