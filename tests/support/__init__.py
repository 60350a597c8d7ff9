"""What the suites share: tolerances and random inputs (:mod:`.numerics`), the one harness
every op's shared suite runs its implementations through (:mod:`.harness`), each op's
entries and cases (:mod:`.implementations` for ``masked_conv``, :mod:`.causal` for
``causal_conv``, :mod:`.short_conv` for ``causal_conv1d``), lowering for a GPU this host
lacks and compiling Pallas' Triton IR for sm_90 (:mod:`.lowering`), the forced CPU
devices of the mesh checks (:mod:`.mesh`), named cases (:mod:`.cases`), lax as an oracle
(:mod:`.lax_oracle`) and the replayed grids of other projects (:mod:`.replay`)."""
