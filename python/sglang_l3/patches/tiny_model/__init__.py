"""Group `tiny-model`: dummy weights for the packaged tiny models (tests, demo)."""
