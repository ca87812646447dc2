"""Group `serving`: what a request may carry into the page keys: checked input ids,
server-derived media hashes (`mm_hashes_guard`, `mm_grid_hash`), a LoRA namespace no client key can name
(`lora_key_namespace`)."""
