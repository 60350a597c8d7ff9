"""What the suites share: tolerances and random inputs (:mod:`.numerics`), each op's
implementations as the shared suites call them (:mod:`.implementations`), lowering for a
GPU this host lacks (:mod:`.lowering`), the forced CPU devices of the mesh checks
(:mod:`.mesh`), named cases (:mod:`.cases`), lax as an oracle (:mod:`.lax_oracle`) and
the replayed grids of other projects (:mod:`.replay`)."""
