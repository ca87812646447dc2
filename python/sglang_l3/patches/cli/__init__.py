"""Group `cli`: the user's command line and start-up (`--hicache-mem-layout buffer_only`,
the start-up checks that refuse a launch which cannot work, the JIT lock's log noise)."""
