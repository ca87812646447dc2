"""Group `tp`: every TP rank decides the same (agreed sidecar heal and flush, verified
restores): the decisions that are reduced across ranks."""
