"""Property-based fuzzing (hypothesis) of masked_conv, causal_conv1d and causal_conv and their
streams against the float64 references, and of bad inputs against the ops' named errors
(issue 36, item 5). Failures found are kept as explicit cases in :mod:`.regressions`."""
