"""Sample prioritization: per-example scores, subset policies, score sources and the
per-epoch bookkeeping that chooses what each epoch trains on."""
