"""Sample prioritization: per-example scores, subset policies (a registry), score sources,
the per-epoch bookkeeping that chooses what each epoch trains on, and `api` for one's own
training loop."""
