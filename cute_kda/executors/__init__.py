"""The executors of a resolved call (:mod:`cute_kda.call`): the stages on the kernels, inference, training."""
