"""Training a run: the loop over epochs and the final report (`loop`), its set-up (`setup`:
the checks before work, the run's parts and checkpoint restored, the loop's parts compiled
ahead), what the loop shares (`run`: the Run, the last good checkpoint), one epoch's step
loop (`step_loop`), which train step a loss trains with (`loss_steps`), and the val/test
metrics and the report (`evaluation`)."""
