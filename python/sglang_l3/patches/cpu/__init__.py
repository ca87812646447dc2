"""Group `cpu`: the real cache stack on a host without an accelerator (unpinned host
pools, pure-torch transfers) and the simulated asynchronous device that tests switch on
(`sim_streams`, only with SGLANG_L3_SIM_STREAMS). Active only with the CPU switch."""
