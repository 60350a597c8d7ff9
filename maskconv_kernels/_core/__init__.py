"""The kernel plumbing every op shares, written once (private; imports nothing above it).

* :mod:`.primitives`: JAX primitives whose kernels are chosen and traced when they are
  lowered, per platform; their abstract evaluation, batching, the warning filter and the
  values that vary over ``shard_map``'s manual axes. The only module that imports
  jax's private modules.
* :mod:`.registry`: an op's implementations table, its default order and its one error.
* :mod:`.partitioning`: kernel calls split along the batch by XLA's SPMD partitioner.
* :mod:`.tiling`: powers of two, ceiling divisions and the split of a long reduction.
* :mod:`.hardware`: the target GPU (SM count, shared memory, compute capability).
* :mod:`.args`: the normalisers of ints, paddings, dtypes and operands every API uses.
"""
