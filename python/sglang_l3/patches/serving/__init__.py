"""Group `serving`: what a request may carry into the page keys: checked input ids,
server-derived media hashes (`mm_page_keys`), a LoRA namespace no client key can name
(`lora_key_namespace`)."""
