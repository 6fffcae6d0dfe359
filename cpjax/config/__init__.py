"""A run's config: every field's check (`schema`, which knows every registry), the validation
that applies them with the cross-field rules (`validation`), and the start-up checks of
data, OOD set, target runs, stream files and checkpoint room (`preflight`)."""
