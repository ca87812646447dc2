"""Group `storage`: the L3 stores SGLang loads (`file`, Mooncake's identity), backed
by `sglang_l3.storage`."""
